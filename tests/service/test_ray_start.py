"""service.launcher.init_ray: a fresh local cluster that misses Ray's start-up deadline is started again (seen
once on the 2-core CI machine: "The current node timed out during startup"); a cluster named by RAY_ADDRESS is
not retried, and the last failure reaches the caller. Ray itself is replaced here: no cluster starts."""

from __future__ import annotations

import pytest
import ray

from service import launcher


class FlakyRay:
    def __init__(self, failures: int):
        self.failures, self.inits, self.shutdowns = failures, [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        if len(self.inits) <= self.failures:
            raise Exception("The current node timed out during startup.")

    def shutdown(self):
        self.shutdowns += 1


@pytest.fixture
def flaky(monkeypatch):
    def make(failures: int, address: str | None = None):
        fake = FlakyRay(failures)
        monkeypatch.setattr(ray, "init", fake.init)
        monkeypatch.setattr(ray, "shutdown", fake.shutdown)
        monkeypatch.setattr(launcher.time, "sleep", lambda s: None)
        if address is None:
            monkeypatch.delenv("RAY_ADDRESS", raising=False)
        else:
            monkeypatch.setenv("RAY_ADDRESS", address)
        return fake

    return make


def test_local_start_is_retried(flaky, tmp_path, capsys):
    fake = flaky(failures=launcher.LOCAL_START_ATTEMPTS - 1)
    launcher.init_ray(str(tmp_path))
    assert len(fake.inits) == launcher.LOCAL_START_ATTEMPTS and fake.shutdowns == launcher.LOCAL_START_ATTEMPTS - 1
    assert all(kw["address"] == "local" for kw in fake.inits)
    assert "did not start" in capsys.readouterr().err


def test_the_last_failure_and_a_named_cluster_are_not_hidden(flaky, tmp_path):
    fake = flaky(failures=launcher.LOCAL_START_ATTEMPTS)
    with pytest.raises(Exception, match="timed out during startup"):
        launcher.init_ray(str(tmp_path))
    assert len(fake.inits) == launcher.LOCAL_START_ATTEMPTS
    fake = flaky(failures=1, address="ray://head:10001")
    with pytest.raises(Exception, match="timed out during startup"):
        launcher.init_ray(str(tmp_path))
    assert len(fake.inits) == 1 and fake.shutdowns == 0
