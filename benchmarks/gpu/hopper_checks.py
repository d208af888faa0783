"""Hopper (sm_90) checks over a Triton kernel's compile output, run on a CPU.

``sm90_compile.py`` compiles every launcher-produced specialisation for sm_90; for the
kernels declared in ``CHECKED`` it hands the TTGIR, PTX, SASS (``cuobjdump -sass`` of the
cubin, Triton's bundled binary), registers, spills, shared memory and the recorded launch
grid to ``check_kernel``. The rules, each a pattern that cost the fused log-prob kernels
time on an H200 (``shared/notes/gpu-audit.md``, sections 2 and 9):

- ``pipelined`` (GEMM-bound): no synchronous global load (``LDG``) inside an MMA loop --
  the operands come by ``cp.async`` (``LDGSTS``) or TMA (``UTMALDG``); an ``LDG`` there is an
  accumulator read or an unpipelined operand, a memory round trip per K step.
- ``while_dot`` (GEMM-bound): no ``tt.dot`` / ``warp_group_dot`` whose innermost loop is an
  ``scf.while`` (Triton software-pipelines ``for`` loops only).
- ``fence`` (every checked kernel): no ``MEMBAR.*GPU`` or ``ATOMG`` inside a loop
  (``tl.atomic_add``'s default ``acq_rel`` puts a GPU-wide fence before each atomic;
  ``sem="relaxed"`` compiles to a fence-free ``RED``).
- ``acc_rmw`` (GEMM-bound): no ``STG`` / ``ATOMG`` / ``RED`` inside an MMA loop (the
  accumulator goes through L2/HBM every K step).
- ``wgmma_n`` (GEMM-bound): every ``wgmma`` has N >= 128 (m64n64 halves the FLOPs per byte
  of shared memory read), and a GEMM-bound kernel issues wgmma at all.
- ``waves`` (every checked kernel): at least one CTA per SM and a last wave at least half
  full, from the launch grid and the occupancy the registers / shared memory allow.
- ``spills`` (every checked kernel): no local-memory spill bytes.

A loop is a backward branch in the SASS; an MMA loop is an innermost one that issues
``HGMMA``.
"""

from __future__ import annotations

import math
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

SMS = 132  # H100 SXM / H200
REGS_PER_SM = 65536
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_CTA = 1024
MAX_THREADS_PER_SM = 2048
MAX_CTAS_PER_SM = 32
MIN_WGMMA_N = 128
MIN_LAST_WAVE = 0.5

CHECKED: dict[str, str] = {
    # the token-chunked path's row kernels: memory-bound epilogues of cuBLAS GEMMs
    "csrc_triton.logprob_rows._row_stats_kernel": "memory",
    "csrc_triton.logprob_rows._row_grad_kernel": "memory",
    # the fully fused log-prob kernels (backend="triton"): GEMM-bound
    "csrc_triton.logprobs._fwd_kernel": "gemm",
    "csrc_triton.logprobs._bwd_hidden_kernel": "gemm",
    "csrc_triton.logprobs._bwd_weight_kernel": "gemm",
    # attention (issue 37): the cascade decode kernels and the tree family (shared prefixes run it)
    "csrc_triton.decode_attention._prefix_attn_kernel": "gemm",
    "csrc_triton.decode_attention._suffix_merge_kernel": "gemm",
    "csrc_triton.tree_attention._fwd_kernel": "gemm",
    "csrc_triton.tree_attention._bwd_dq_kernel": "gemm",
    "csrc_triton.tree_attention._bwd_dkdv_kernel": "gemm",
}
"""Kernel (module.name) -> "gemm" (every rule) or "memory" (fence, waves, spills)."""

KNOWN_FAILING: dict[str, set[str]] = {
    # kept selectable by name (backend="triton"); the audit's findings, now checked: the
    # backward kernels accumulate through global memory in their MMA loops (fp32 RMW, acq_rel
    # atomics), all three issue 64- or 32-wide wgmma, and at a few thousand tokens the forward
    # and the atomic backward leave a last wave under 20% full; the fp32 bwd_weight variant
    # spills. ``auto`` does not pick them on CUDA.
    "csrc_triton.logprobs._fwd_kernel": {"wgmma_n", "waves"},
    "csrc_triton.logprobs._bwd_hidden_kernel": {"wgmma_n", "acc_rmw", "fence", "pipelined", "waves"},
    "csrc_triton.logprobs._bwd_weight_kernel": {"wgmma_n", "acc_rmw", "pipelined", "spills"},
    # attention (issue 37), rewritten with pipelined for loops, accumulators in registers, relaxed
    # atomics after the loop and no spills (while_dot, acc_rmw, fence and spills pass); what is
    # still open, until a GPU times them: the decode kernels' dots are 16-64 rows (a group's G*R
    # query rows, R packed heads), so they issue m64n16-n64 wgmma or mma.sync; the tree kernels'
    # forward and dq read the next key block's index with one synchronous LDG per iteration
    # (the CSR list), dq and dK/dV issue m64n64 (128-wide tiles spill); at the subset's small
    # shapes every grid leaves a thin last wave.
    "csrc_triton.decode_attention._prefix_attn_kernel": {"wgmma_n", "waves"},
    "csrc_triton.decode_attention._suffix_merge_kernel": {"wgmma_n", "waves"},
    "csrc_triton.tree_attention._fwd_kernel": {"pipelined", "wgmma_n", "waves"},
    "csrc_triton.tree_attention._bwd_dq_kernel": {"pipelined", "wgmma_n", "waves"},
    "csrc_triton.tree_attention._bwd_dkdv_kernel": {"wgmma_n", "waves"},
}
"""Kernels that fail some rules, and which (a rule outside the set, or a set rule that
passes everywhere, is a failure of ``sm90_compile.py``: the list must stay true)."""

_SASS_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,6})\*/\s+(.*?)\s*;")
_PRED = re.compile(r"^@!?U?P[T\d]+\s+")
_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m(\d+)n(\d+)k(\d+)")
_DOT = re.compile(r"\btt\.dot\b|\bttng\.warp_group_dot\b")


@dataclass
class Compiled:
    """What the checks read of one compiled launch."""

    name: str
    ttgir: str
    ptx: str
    sass: str
    registers: int
    spill_bytes: int
    shared_bytes: int
    num_warps: int
    grid: tuple
    extra: dict = field(default_factory=dict)


def cuobjdump() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def sass_of(cubin: bytes) -> str:
    """SASS text of a cubin (Triton's bundled cuobjdump)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(cuobjdump()), "-sass", f.name], capture_output=True, text=True, check=True).stdout


def sass_loops(sass: str) -> list[dict]:
    """Every SASS loop (a backward branch: [target, branch]) with its opcode counts and
    whether it is innermost (no other loop strictly inside it)."""
    ins = []
    for line in sass.splitlines():
        m = _SASS_INSTR.match(line)
        if m:
            ins.append((int(m.group(1), 16), _PRED.sub("", m.group(2).strip())))
    loops = []
    for addr, op in ins:
        if not op.startswith("BRA"):
            continue
        t = re.search(r"0x([0-9a-f]+)", op)
        if not t or int(t.group(1), 16) >= addr:
            continue
        lo = int(t.group(1), 16)
        body = [o.split()[0] for a, o in ins if lo <= a <= addr]

        def count(prefix: str) -> int:
            return sum(o == prefix or o.startswith(prefix + ".") for o in body)

        loops.append(dict(lo=lo, hi=addr, n=len(body), HGMMA=count("HGMMA"), LDG=count("LDG"), LDGSTS=count("LDGSTS"),
                          UTMALDG=count("UTMALDG"), STG=count("STG"), ATOMG=count("ATOMG"), RED=count("RED") + count("REDG"),
                          MEMBAR_GPU=sum(o.startswith("MEMBAR") and "GPU" in o for o in body)))
    for lp in loops:
        lp["inner"] = not any(o is not lp and lp["lo"] <= o["lo"] and o["hi"] <= lp["hi"] and o != lp for o in loops)
    return loops


def dots_under_while(ttgir: str) -> int:
    """How many dot ops have an ``scf.while`` (either of its regions) as their innermost loop."""
    stack: list[str] = []
    found = 0
    for line in ttgir.splitlines():
        s = line.strip()
        if _DOT.search(s):
            loops = [k for k in stack if k != "other"]
            found += bool(loops) and loops[-1] == "while"
        kind = "while" if ("scf.while" in s or s.startswith("} do {")) else ("for" if "scf.for" in s else "other")
        in_string = False
        for ch in s:
            if ch == '"':
                in_string = not in_string
            elif in_string:
                continue
            elif ch == "}":
                if stack:
                    stack.pop()
            elif ch == "{":
                stack.append(kind)
    return found


def wgmma_shapes(ptx: str) -> list[tuple[int, int, int]]:
    return sorted({tuple(int(x) for x in m) for m in _WGMMA.findall(ptx)})


def ctas_per_sm(registers: int, num_warps: int, shared_bytes: int) -> int:
    """Resident CTAs per SM that registers, shared memory and threads allow."""
    threads = 32 * num_warps
    per_warp = math.ceil(max(registers, 1) * 32 / REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = REGS_PER_SM // (per_warp * num_warps)
    by_smem = SMEM_PER_SM // (shared_bytes + SMEM_RESERVED_PER_CTA)
    return max(0, min(by_regs, by_smem, MAX_THREADS_PER_SM // threads, MAX_CTAS_PER_SM))


def check_kernel(c: Compiled, kind: str) -> dict[str, str]:
    """rule -> what broke it, for the rules of ``kind`` ("gemm" or "memory"); {} is clean."""
    if kind not in ("gemm", "memory"):
        raise ValueError(f"kind must be 'gemm' or 'memory', got {kind!r}")
    out: dict[str, str] = {}
    loops = sass_loops(c.sass)
    mma_loops = [lp for lp in loops if lp["inner"] and lp["HGMMA"]]
    fenced = [lp for lp in loops if lp["MEMBAR_GPU"] or lp["ATOMG"]]
    if fenced:
        lp = fenced[0]
        out["fence"] = f"loop 0x{lp['lo']:x}-0x{lp['hi']:x}: {lp['MEMBAR_GPU']} MEMBAR.GPU, {lp['ATOMG']} ATOMG per iteration"
    if kind == "gemm":
        rmw = [lp for lp in mma_loops if lp["STG"] or lp["ATOMG"] or lp["RED"]]
        if rmw:
            lp = rmw[0]
            out["acc_rmw"] = (f"MMA loop 0x{lp['lo']:x}-0x{lp['hi']:x}: {lp['STG']} STG, {lp['ATOMG']} ATOMG, "
                              f"{lp['RED']} RED per iteration")
        sync = [lp for lp in mma_loops if lp["LDG"]]
        if sync:
            lp = sync[0]
            out["pipelined"] = (f"MMA loop 0x{lp['lo']:x}-0x{lp['hi']:x}: {lp['LDG']} synchronous LDG beside "
                                f"{lp['LDGSTS']} LDGSTS / {lp['UTMALDG']} UTMALDG")
        n_while = dots_under_while(c.ttgir)
        if n_while:
            out["while_dot"] = f"{n_while} dot(s) inside an scf.while (not software-pipelined)"
        shapes = wgmma_shapes(c.ptx)
        narrow = [f"m{m}n{n}k{k}" for m, n, k in shapes if n < MIN_WGMMA_N]
        if not shapes:
            out["wgmma_n"] = "no wgmma in a GEMM-bound kernel"
        elif narrow:
            out["wgmma_n"] = f"wgmma {narrow}: N < {MIN_WGMMA_N}"
    per_sm = ctas_per_sm(c.registers, c.num_warps, c.shared_bytes)
    ctas = math.prod(int(g) for g in c.grid)
    if per_sm == 0:
        out["waves"] = "no CTA fits on an SM"
    else:
        waves = ctas / (per_sm * SMS)
        last = waves - math.floor(waves)
        if ctas < SMS:
            out["waves"] = f"grid of {ctas} CTAs < {SMS} SMs"
        elif waves > 1 and 0 < last < MIN_LAST_WAVE:
            out["waves"] = f"{ctas} CTAs at {per_sm}/SM = {waves:.2f} waves: last wave {100 * last:.0f}% full"
    if c.spill_bytes:
        out["spills"] = f"{c.spill_bytes} bytes spilled"
    return out


def verdict(qualname: str, problems: dict[str, str]) -> list[str]:
    """Failures of a checked kernel's problems against ``KNOWN_FAILING``: an unexpected rule."""
    allowed = KNOWN_FAILING.get(qualname, set())
    return [f"{rule}: {why}" for rule, why in sorted(problems.items()) if rule not in allowed]


def stale_known_failures(seen: dict[str, set[str]]) -> list[str]:
    """``KNOWN_FAILING`` entries no compiled variant broke (``seen``: kernel -> rules broken
    by some variant); only kernels that were compiled are judged."""
    return [f"{k}: listed as failing {rule} but no variant does" for k, rules in sorted(KNOWN_FAILING.items())
            if k in seen for rule in sorted(rules - seen[k])]
