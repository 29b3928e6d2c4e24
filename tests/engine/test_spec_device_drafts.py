"""engine.execution.spec_fixed's device-held drafts: a fixed step leaves each request's drafts on the device
(DeviceDrafts: a column of its picks) and the next fixed step writes them into its verify tokens and its acceptance
(fill_device_drafts), host-known drafts and padding untouched; cuts and reads behave as on a list; an aborted
request's drafts go with it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.execution.sampling_params import SamplingParams
from engine.execution.spec_fixed import DeviceDrafts, fill_device_drafts
from engine.loading.make_model import make_model
from engine.loading.weights import load_weights
from engine.model.config import ModelConfig
from tests.engine.test_spec_bucketed import _engine


def _plan(device=None):
    return SimpleNamespace(device=device)


def test_fill_places_each_column_at_its_slot_and_leaves_the_rest():
    g = torch.Generator().manual_seed(0)
    older, newer = torch.randint(0, 1000, (3, 4), generator=g), torch.randint(0, 1000, (3, 2), generator=g)
    plans = [
        _plan(DeviceDrafts(newer, 1, 3)),
        _plan(None),  # host-known drafts: left as the host wrote them
        _plan(DeviceDrafts(older, 2, 1)),  # from another step's picks (a second source)
        _plan(DeviceDrafts(newer, 0, 0)),  # cut to nothing (no room)
    ]
    q = 4
    row = torch.full((len(plans) * q,), -7, dtype=torch.int64)
    fill_device_drafts(row, plans, q, 1)
    want = torch.full_like(row, -7)
    want[1:4] = newer[:3, 1]
    want[2 * q + 1] = older[0, 2]
    assert torch.equal(row, want)
    flat = torch.full((len(plans) * (q - 1),), -1, dtype=torch.int64)  # the acceptance's drafts [n, q - 1]
    fill_device_drafts(flat, plans, q - 1, 0)
    assert flat.view(len(plans), q - 1)[0].tolist() == newer[:3, 1].tolist()
    assert flat.view(len(plans), q - 1)[2].tolist() == [int(older[0, 2]), -1, -1]


def test_cuts_and_values_behave_as_a_list():
    picks = torch.arange(12).view(3, 4)
    d = DeviceDrafts(picks, 2, 3)
    assert len(d) == 3 and d.values() == [2, 6, 10]
    assert d[:2].values() == [2, 6] and len(d[:0]) == 0 and d[:5].values() == [2, 6, 10] and len(d[:]) == 3
    with pytest.raises(ValueError, match="leading cuts"):
        d[1:]


def test_an_aborted_request_leaves_no_drafts_behind(tmp_path):
    """A sampled request aborted between steps holds drafts and their q rows (fp32 vocabulary rows on the device):
    abort drops them with the request (a service whose clients disconnect would otherwise leak device memory)."""
    path = make_model("tiny", tmp_path / "m", seed=3, mtp_layers=1)
    cfg = ModelConfig.from_model_dir(path)
    engine = _engine((cfg, load_weights(path, cfg, mtp=True)), 2)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, ignore_eos=True)
    rid = engine.add_request([5, 6, 7, 8], params, seed=1)
    while len(engine.requests[rid].output) < 3:
        engine.step()
    spec = engine.speculator
    assert rid in spec.drafts and rid in spec.draft_q  # drafted, sampled: q rows kept
    engine.abort(rid)
    assert rid not in spec.drafts and rid not in spec.draft_q
