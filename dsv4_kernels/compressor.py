"""Compressor window pooling reference (CSA ratio 4 with overlap, HCA ratio 128 without).

Every token is projected to `kv` and `score` (= gate + ape[pos % ratio]), each `coff * d` wide
(coff = 2 with overlap). Entry w of a ratio-r compressor pools, channel by channel, with softmax weights
over its slots:
- no overlap: the r tokens of window w (slot j = token r*w + j);
- overlap: 2r slots, the first r take the *first half* (Ca) of window w-1's tokens, the last r the
  *second half* (Cb) of window w's tokens. Window -1 does not exist: its slots get score -inf (weight 0).
The pooled vector is RMS-normalised and rotated at the window's first position (compress RoPE) by the
caller. This module only knows how to turn gathered slot rows into entries, so the same code serves
prefill (slots from the chunk) and decode (slots from the compressor state); `state_rows` builds the state
ring rows a step saves for later steps.
"""

import torch


def overlap_slots(
    kv_prev: torch.Tensor,
    score_prev: torch.Tensor,
    kv_cur: torch.Tensor,
    score_cur: torch.Tensor,
    prev_valid: torch.Tensor,
):
    """Arrange the 2r overlap slots of N entries.

    kv_prev/score_prev: [N, r, 2d] rows of window w-1; kv_cur/score_cur: [N, r, 2d] rows of window w;
    prev_valid: bool [N] (False for w == 0). -> (kv [N, 2r, d], score [N, 2r, d]).
    """
    d = kv_cur.shape[-1] // 2
    prev_score = score_prev[..., :d].masked_fill(~prev_valid.view(-1, 1, 1), float("-inf"))
    prev_kv = kv_prev[..., :d].masked_fill(~prev_valid.view(-1, 1, 1), 0.0)
    kv = torch.cat([prev_kv, kv_cur[..., d:]], dim=1)
    score = torch.cat([prev_score, score_cur[..., d:]], dim=1)
    return kv, score


def pool_windows(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Softmax-weighted sum over slots. kv, score: [N, slots, d] -> [N, d] in kv.dtype (softmax in fp32)."""
    weights = score.float().softmax(dim=1).to(kv.dtype)
    return (kv * weights).sum(dim=1)


def state_rows(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The compressor state ring's fp32 rows [kv | score], score = gate + ape[position % ratio].

    kv, gate: [T, W] (W = coff * d, model dtype); ape: [ratio, W]; positions: int [T] -> fp32 [T, 2W].
    """
    score = gate.float() + ape[positions % ape.shape[0]].float()
    return torch.cat([kv.float(), score], dim=-1)
