"""The portable code path (no AVX512-VNNI, F16C or PSHUFB) and the AVX2 path (AVX2, F16C, PSHUFB,
no AVX512) of every format, against ggml.

A subprocess with NUMBA_CPU_NAME=generic (which simd.py's host probe reads as "no host
features", so only portable LLVM IR is emitted), or with NUMBA_CPU_NAME=haswell and its features
in NUMBA_CPU_FEATURES (which the probe reads as the features), and its own NUMBA_CACHE_DIR runs
every weight format's vec_dot row function (and its multi-row rows_dot and four-row vec_dot4,
where it has them) and every activation quantizer on ggml's fixtures (tests/data/kernels/FMT.npz:
ggml's activation bytes and vec_dot outputs) and compares bit for bit. Hosts with AVX512-VNNI
run the VNNI path everywhere else, AVX2 hosts the AVX2 path: this covers the one they do not.
"""

import importlib
import json
import os
import subprocess
import sys

import pytest

from conftest import KERNELS, ROOT
from synapse_nb import formats as F

pytestmark = [pytest.mark.slow, pytest.mark.cold_compile]  # every kernel, generic CPU, a fresh cache

_CHECK = r"""
import importlib, json, sys
import numpy as np
from synapse_nb import formats as F
from synapse_nb.kernels import simd
from synapse_nb.kernels.decorator import python_call

KERNELS = sys.argv[1]
if sys.argv[2] == "generic":
    assert not (simd.HAS_VNNI256 or simd.HAS_F16C or simd.HAS_PSHUFB or simd.HAS_AVX2), simd.HOST_FEATURES
else:
    assert simd.HAS_AVX2 and simd.HAS_F16C and simd.HAS_PSHUFB and not (simd.HAS_VNNI256 or simd.HAS_VNNI512)
res = {}
for fmt in F.weight_formats():
    z = np.load(f"{KERNELS}/{fmt.name.lower()}.npz")
    act = F.format_of(fmt.vec_dot_type)
    # (row functions are nested kernels: called from Python through python_call)
    quant = python_call(getattr(importlib.import_module(f"synapse_nb.kernels.{act.quantize_kernels}"),
                                f"quantize_row_{act.stem}"))
    mod = importlib.import_module(f"synapse_nb.kernels.{fmt.kernels}")
    dot = python_call(getattr(mod, fmt.vec_dot_name()))
    rows_dot, dot4 = (python_call(getattr(mod, n)) if hasattr(mod, n) else None
                      for n in (fmt.rows_dot_name(), fmt.vec_dot4_name()))
    x, act_ref, y_ref = z["x"], z["act_bytes"], z["y"]
    w = np.ascontiguousarray(z["weight_bytes"]).view(np.uint8).reshape(y_ref.shape[1], -1)
    a = np.empty_like(act_ref)
    for n in range(x.shape[0]):
        quant(a[n], np.ascontiguousarray(x[n]))
    scratch = np.empty(2 * x.shape[1] + 128, np.int32)
    rows = range(0, w.shape[0], 3)
    y = np.array([[dot(w[m], a[n], scratch) for m in rows] for n in range(a.shape[0])], np.float32)
    rows_ok = None  # (no multi-row kernel)
    if rows_dot is not None:  # the multi-row kernel (matmul with N > 1), all 8 rows at once
        yr = np.zeros_like(y_ref)
        for m in rows:
            rows_dot(yr, m, w[m], a)
        rows_ok = bool(np.array_equal(yr[:, ::3].view(np.uint32), y_ref[:, ::3].view(np.uint32)))
    dot4_ok = None  # (no four-row kernel)
    if dot4 is not None:  # the matvec's four-row kernel, on row groups m..m+3 for m = 0, 12, 24, ...
        y4 = np.zeros_like(y_ref)
        for n in range(a.shape[0]):
            for m in range(0, w.shape[0] - 3, 12):
                dot4(y4[n], m, w, a[n])
        sel = np.arange(w.shape[0]) % 12 < 4
        dot4_ok = bool(np.array_equal(y4[:, sel].view(np.uint32), y_ref[:, sel].view(np.uint32)))
    res[fmt.name] = {"act": bool(np.array_equal(a, act_ref)),
                     "dot": bool(np.array_equal(y.view(np.uint32), y_ref[:, ::3].view(np.uint32))),
                     "rows_dot": rows_ok, "dot4": dot4_ok, "n": int(y.size)}
print(json.dumps(res))
"""


# Haswell's features (AVX2, FMA, F16C; no AVX-512): what Numba compiles for under this name
_HASWELL = "+avx,+avx2,+bmi,+bmi2,+cx16,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,+popcnt,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3"


def _host_has_avx2():
    from llvmlite import binding
    return bool(dict(binding.get_host_cpu_features()).get("avx2"))


@pytest.mark.parametrize("path", ["generic", "avx2"])
def test_portable_path_of_every_format_matches_ggml(tmp_path, path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    if path == "generic":
        env["NUMBA_CPU_NAME"] = "generic"
        env.pop("NUMBA_CPU_FEATURES", None)
    else:
        if not _host_has_avx2():
            pytest.skip("the host has no AVX2: it cannot run the AVX2 path")
        env.update(NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=_HASWELL)
    r = subprocess.run([sys.executable, "-c", _CHECK, str(KERNELS), path], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(res) == sorted(f.name for f in F.weight_formats())
    bad = {k: v for k, v in res.items()
           if not (v["act"] and v["dot"] and v["rows_dot"] is not False and v["dot4"] is not False
                   and v["n"] >= 8 * 256)}
    assert not bad, bad
    with_dot4 = [f.name for f in F.weight_formats()
                 if hasattr(importlib.import_module(f"synapse_nb.kernels.{f.kernels}"), f.vec_dot4_name())]
    assert {"Q4_0", "Q4_K", "Q6_K", "IQ4_XS"} <= set(with_dot4)
    assert all(res[name]["dot4"] for name in with_dot4), res
