"""Numba's on-disk cache of the kernels: found again by a new process, and never stale.

Each check runs fresh Python processes (a cache hit or miss is decided when a process first calls
a kernel) with their own NUMBA_CACHE_DIR, so the repository's cache is neither used nor touched.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.cold_compile]  # every test compiles in its own fresh cache

# One matmul per driver template variant (F32: per-pair loop; Q4_0: rows_dot for N > 1), plus
# get_rows; prints each used driver's cache statistics.
_USE_DRIVERS = r"""
import importlib, json
import numpy as np
from gguf import GGMLQuantizationType as GT
from synapse_nb import formats as F
from synapse_nb.kernels import get_rows, matmul
MM = importlib.import_module("synapse_nb.kernels.matmul")

class W:
    def __init__(self, name, m, k):
        fmt = F.format_of(name)
        self.name, self.ggml_type, self.shape = name, fmt.ggml_type, (m, k)
        self.data = np.arange(m * fmt.row_bytes(k), dtype=np.int64).astype(np.uint8)
        if name == "Q4_0":
            self.data.reshape(-1, 18)[:, 1] = 0x20  # finite F16 scales
stats = {}
for name in ("F32", "Q4_0"):
    w = W(name, 20, 64)
    x = np.linspace(-1, 1, 3 * 64, dtype=np.float32).reshape(3, 64)
    matmul(w, x[:1].copy()); matmul(w, x); get_rows(w, [0, 3])
    k = MM.KERNELS[name]
    for d in (k.act, k.mv.launch, k.mv.chunk, k.mm.launch, k.mm.chunk, k.deq):  # matmul.Chunked: launch, chunk
        s = d.stats
        stats[d.__name__] = [sum(s.cache_hits.values()), sum(s.cache_misses.values())]
print(json.dumps(stats))
"""


def _run(code, cache_dir, cwd=ROOT):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir))
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


def test_generated_drivers_load_from_cache_in_a_new_process(tmp_path):
    first = json.loads(_run(_USE_DRIVERS, tmp_path))
    assert set(first) == {"_act_f32", "_mv_f32", "_mm_f32", "_deq_f32", "_act_q8_0", "_mv_q4_0", "_mm_q4_0",
                          "_deq_q4_0", "mv_launch", "mm_launch"}
    assert all(misses > 0 for hits, misses in first.values()), first  # compiled here
    second = json.loads(_run(_USE_DRIVERS, tmp_path))
    # nothing recompiled: every signature used came from the cache written by the first process
    assert all(hits > 0 and misses == 0 for hits, misses in second.values()), second


# matvec of an F32 weight of 2 rows: _mv_any_f32 (rows not a multiple of 4) inlines legacy.vec_dot_f32, whose reduction is block_ir.reduce64's IR
# (simd.ir_reduce_add_16).
_F32_DOT = r"""
import importlib, json
import numpy as np
from gguf import GGMLQuantizationType as GT
import synapse_nb
from synapse_nb.kernels import matvec
MM = importlib.import_module("synapse_nb.kernels.matmul")

class W:
    name, ggml_type, shape = "w", GT.F32, (2, 64)
    data = np.ones(128, np.float32).view(np.uint8)
y = matvec(W(), np.ones(64, np.float32))
s = MM._mv_any_f32.stats
print(json.dumps({"file": synapse_nb.__file__, "y": float(y[0]),
                  "hits": sum(s.cache_hits.values()), "misses": sum(s.cache_misses.values())}))
"""


def test_edit_to_an_inlined_helper_invalidates_every_cached_kernel(tmp_path):
    """Edit simd.py in a copy of the package: the driver in matmul.py recompiles with the edit."""
    shutil.copytree(ROOT / "synapse_nb", tmp_path / "synapse_nb",
                    ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc"))
    cache = tmp_path / "numba_cache"

    def run():
        return json.loads(_run(_F32_DOT, cache, cwd=tmp_path))

    first = run()
    assert first["file"] == str(tmp_path / "synapse_nb" / "__init__.py")
    assert first["y"] == 64.0 and first["misses"] > 0
    simd = tmp_path / "synapse_nb" / "kernels" / "simd.py"
    src = simd.read_text()
    old = "    a = builder.fadd(sh(u, [0, 1]), sh(u, [2, 3]))\n"
    assert src.count(old) == 1  # in ir_reduce_add_16: (u0 + u2, u1 + u3), then their sum is returned
    simd.write_text(src.replace(old, old + "    a = builder.fadd(a, ir.Constant(a.type, [0.5, 0.5]))\n"))
    second = run()
    assert second["y"] == 65.0 and second["misses"] > 0  # the new helper, not the cached driver
    third = run()
    assert third["y"] == 65.0 and third["hits"] > 0 and third["misses"] == 0  # and cached again


# llama-decode's process setup (synapse_nb.jit.fast_start): kernels loaded from the cache without
# Numba's registry refresh, with NRT's functions from a cached object and their bitcode parsed
# only when needed. A kernel that allocates (NRT), then a new function compiled in the same process
# that calls a loaded kernel (links in its bitcode: parsed then, after the registries load).
_FAST_START = r"""
import glob, json, os, sys
import numba
import numpy as np
from synapse_nb.jit import fast_start
fast_start()
from synapse_nb.kernels import get_rows, ops
from synapse_nb.kernels.cache_locators import cache_dir

class W:
    name, ggml_type, shape = "w", 0, (3, 64)  # F32
    data = np.arange(192, dtype=np.float32).view(np.uint8)
rows = get_rows(W(), [2, 0])  # _deq_f32 (parallel, allocates nothing) and the checks
theta = float(ops.rope_theta_scale(np.float32(10000.0), 64))
arrayobj = "numba.np.arrayobj" in sys.modules  # loads import none of Numba's implementations
twice = numba.njit(lambda b, n: ops.rope_theta_scale(b, n) * np.float32(2.0))
s = ops.rope_theta_scale.stats
print(json.dumps({"rows": rows[:, :2].tolist(), "theta": theta, "twice": float(twice(np.float32(10000.0), 64)),
                  "hits": sum(s.cache_hits.values()), "misses": sum(s.cache_misses.values()),
                  "nrt": len(glob.glob(os.path.join(cache_dir(), "numba_nrt-*.nbc"))),
                  "arrayobj": arrayobj}))
"""


def test_fast_start_loads_cached_kernels_that_a_new_compile_can_link(tmp_path):
    first = json.loads(_run(_FAST_START, tmp_path))  # compiles, saves the kernels and NRT's object
    assert first["misses"] > 0 and first["nrt"] == 1
    second = json.loads(_run(_FAST_START, tmp_path))  # loads them
    assert second["hits"] > 0 and second["misses"] == 0 and second["nrt"] == 1
    assert second["rows"] == first["rows"] == [[128.0, 129.0], [0.0, 1.0]]
    assert second["theta"] == first["theta"] and second["twice"] == first["twice"] == 2 * first["theta"]
    # the entries refer to Numba's environment rebuild by name (not a copy of fast_start's
    # replacement, whose frozen globals would import numba.np.arrayobj at every load)
    entries = [p.read_bytes() for p in tmp_path.rglob("*.nbc")]
    assert entries and not any(b"_environments_without_imports" in e for e in entries)
    assert not second["arrayobj"]


# fast_start pauses the cyclic garbage collector for the start: a compile resumes it (Numba's
# compiler makes garbage); else the warm-up's end (start_done) does, the start's objects frozen.
_GC = r"""
import gc, json
from synapse_nb.jit import fast_start, start_done
fast_start()
paused = not gc.isenabled()
import numpy as np
from synapse_nb.kernels import ops
ops.rope_theta_scale(np.float32(10000.0), 64)  # compiled (an empty cache) or loaded
at_kernel = gc.isenabled()
start_done()
print(json.dumps({"paused": paused, "at_kernel": at_kernel, "enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}))
"""


def test_fast_start_pauses_the_garbage_collector_until_a_compile_or_the_start_done(tmp_path):
    cold = json.loads(_run(_GC, tmp_path))
    assert cold == {"paused": True, "at_kernel": True, "enabled": True, "frozen": 0}
    warm = json.loads(_run(_GC, tmp_path))
    assert warm["paused"] and not warm["at_kernel"] and warm["enabled"] and warm["frozen"] > 10_000, warm


# A script that calls fast_start and exits without start_done: the compile watch that resumes the
# collector ends at exit (atexit), before the interpreter's teardown (which had closed it with
# Numba's modules cleared: "Exception ignored in: <generator object watch_compiles>").
_EXIT_WITHOUT_START_DONE = r"""
import atexit, json
from numba.core import event
from synapse_nb import jit
before = len(event._registered["numba:compile"])
jit.fast_start()
watching = len(event._registered["numba:compile"]) - before
atexit._run_exitfuncs()
print(json.dumps({"watching": watching, "after_exit": len(event._registered["numba:compile"]) - before}))
"""


def test_fast_start_without_start_done_ends_its_compile_watch_at_exit(tmp_path):
    assert json.loads(_run(_EXIT_WITHOUT_START_DONE, tmp_path)) == {"watching": 1, "after_exit": 0}


# jit.release_library_pages: LLVM's library pages unmapped (they leave the resident set), and
# compiling, loading and running kernels afterwards works as before (the pages map again).
_RELEASE = r"""
import json, sys
import numba
import numpy as np
from synapse_nb.jit import release_library_pages
from synapse_nb.kernels import ops

def llvm_rss():
    kb, name = 0, None
    for line in open("/proc/self/smaps"):
        if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
            name = line.split()[-1]
        elif line.startswith("Rss:") and name.endswith("libllvmlite.so"):
            kb += int(line.split()[1])
    return kb

theta = float(ops.rope_theta_scale(np.float32(10000.0), 64))
before = llvm_rss()
release_library_pages()
after = llvm_rss()
twice = numba.njit(lambda b, n: ops.rope_theta_scale(b, n) * np.float32(2.0))
print(json.dumps({"before": before, "after": after, "theta": theta,
                  "again": float(ops.rope_theta_scale(np.float32(10000.0), 64)),
                  "twice": float(twice(np.float32(10000.0), 64))}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps and madvise: Linux")
def test_release_library_pages_keeps_numba_working(tmp_path):
    r = json.loads(_run(_RELEASE, tmp_path))
    assert r["before"] > 10_000 and r["after"] < r["before"] // 2, r  # KiB of libllvmlite.so resident
    assert r["again"] == r["theta"] and r["twice"] == 2 * r["theta"]
