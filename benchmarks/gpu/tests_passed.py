"""Exit 0 when the tests of a benchmark module's kernels passed, read from a pytest JUnit XML
file or from ``stream_outcomes.py``'s outcome lines (``.tsv``: written test by test, so a test
stage stopped at its timeout still has one).

``python benchmarks/gpu/tests_passed.py tests_outcomes.tsv policy_loss`` (used by run.sh: a
kernel is timed only after its correctness tests passed on the same device). Test files that
did not run (a dry run runs only a few) do not count against a module; a missing report does.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

# benchmark module -> test files that check its kernels against the reference
MODULE_TESTS = {
    "policy_loss": ("tests/ops/test_policy_loss.py", "tests/ops/test_kl.py", "tests/reference/test_policy_loss_reference.py"),
    "advantages": ("tests/ops/test_advantages.py", "tests/ops/test_whiten.py", "tests/reference/test_advantages_reference.py"),
    "scans": ("tests/ops/test_scans.py", "tests/reference/test_scans_reference.py"),
    "logprobs": ("tests/ops/test_logprobs.py", "tests/ops/test_fused_linear_policy_loss.py"),
    "rollout": ("tests/rollout/test_decode_attention.py", "tests/rollout/test_decode_attention_precision.py", "tests/rollout/test_decode_cascade.py"),
    "tree_attention": ("tests/ops/test_tree_attention.py", "tests/ops/test_hf_tree.py", "tests/ops/test_shared_prefix_attention.py"),
}


def failures(report_path: str, module: str) -> list[str]:
    if report_path.endswith(".tsv"):
        return _tsv_failures(report_path, module)
    xml_path = report_path
    files = MODULE_TESTS[module]
    bad = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        # junit classname: tests.ops.test_policy_loss (dots for the path)
        path = case.get("classname", "").split(".")
        src = "/".join(p for p in path if not p[:1].isupper()) + ".py"
        if src in files and any(c.tag in ("failure", "error") for c in case):
            bad.append(f"{case.get('classname')}::{case.get('name')}")
    return bad


def _tsv_failures(path: str, module: str) -> list[str]:
    """Failed tests of the module's files, and collected ones that never got an outcome (a stage
    stopped at its timeout first): a kernel is timed only after its tests ran and passed."""
    files = MODULE_TESTS[module]
    collected, ended, failed = [], set(), []
    with open(path) as f:
        for line in f:
            outcome, _, nodeid = line.rstrip("\n").partition("\t")
            if nodeid.split("::", 1)[0] not in files:
                continue
            if outcome == "collected":
                collected.append(nodeid)
            else:
                ended.add(nodeid)
                if outcome == "failed":
                    failed.append(nodeid)
    return failed + [f"{nodeid} (not reached)" for nodeid in dict.fromkeys(collected) if nodeid not in ended]


if __name__ == "__main__":
    xml_path, module = sys.argv[1], sys.argv[2]
    try:
        bad = failures(xml_path, module)
    except (OSError, ET.ParseError) as exc:
        print(f"{module}: no test report ({exc})")
        sys.exit(1)
    if bad:
        print(f"{module}: {len(bad)} failing tests, e.g. {bad[:3]}")
        sys.exit(1)
    sys.exit(0)
