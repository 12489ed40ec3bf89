"""The OpenBLAS preload refuses a build whose kernels this CPU cannot run."""

from __future__ import annotations

import pytest

from stepline.engine import _blas


class _FakeOpenBLAS:
    """Stands in for a locally loaded libopenblas: only its core name is read."""

    def __init__(self, core: bytes):
        self.openblas_get_corename = lambda: core


@pytest.mark.parametrize("core", [b"SKYLAKEX", b"CooperLake", b"SAPPHIRERAPIDS"])
def test_an_avx512_build_is_refused_on_a_cpu_without_avx512(monkeypatch, core: bytes) -> None:
    monkeypatch.setattr(_blas, "_cpu_flags", lambda: {"sse4_2", "avx", "avx2", "fma"})
    reason = _blas._unfit_for_cpu(_FakeOpenBLAS(core))
    assert reason is not None and "AVX-512" in reason


@pytest.mark.parametrize(
    ("flags", "core"),
    [({"avx2", "avx512f"}, b"SKYLAKEX"), ({"avx2", "fma"}, b"ZEN"), ({"avx2"}, b"HASWELL")],
)
def test_a_build_the_cpu_can_run_is_accepted(monkeypatch, flags: set, core: bytes) -> None:
    monkeypatch.setattr(_blas, "_cpu_flags", lambda: flags)
    assert _blas._unfit_for_cpu(_FakeOpenBLAS(core)) is None
