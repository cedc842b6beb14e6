"""Which Triton kernels a change recompiles differently, without a GPU.

    python benchmarks/ptx_diff.py --tree .baseline --tree .

Each tree compiles its kernels for sm_90 as the host code launches them (the set of
`tests/test_attention_kernels.py --compile-for-hopper`, which writes their PTX with
`--ptx-dir`), under this machine's Triton; then the PTX of each launch is compared with
source-line records (`.loc`, `.file`), comments and debug sections left out.  "same" means
the same instructions, so a change that leaves a kernel "same" cannot change its speed on
that Triton.  A constexpr that only one tree has is ignored when it is off (False / 0 /
None), so a new knob that defaults off still matches the launch it leaves alone.

The GPU's Triton may be another version than this machine's (the lent H200 has 3.6): a
"same" here is strong evidence, not proof, for that one.  Needs both trees to have
`--ptx-dir` (since this script's commit).
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

DEBUG_LABEL = re.compile(r"\$L__tmp\d+:")


def compile_tree(tree: str, out: str) -> None:
    shutil.rmtree(out, ignore_errors=True)  # the launches are numbered by what is there
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.abspath(tree), env.get("PYTHONPATH")]))
    script = os.path.join(os.path.abspath(tree), "tests", "test_attention_kernels.py")
    r = subprocess.run([sys.executable, script, "--compile-for-hopper", "--ptx-dir", out], env=env,
                       cwd=tree, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"{tree}: the compile failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}")


def instructions(ptx: str) -> list[str]:
    """The PTX body without what moves with source lines and inlined helpers (line records,
    comments, debug sections, the `$L__tmp` labels that only debug records name)."""
    body = []
    for line in ptx.splitlines():
        if line.lstrip().startswith(".section") and ".debug" in line:
            break
        line = line.split("//", 1)[0].strip()
        if line and not line.startswith((".loc", ".file")) and not DEBUG_LABEL.fullmatch(line):
            body.append(line)
    return body


def read_tree(folder: str) -> list[tuple[str, dict, str, list[str]]]:
    """(kernel, constexprs, options, instructions) for each compiled launch, in order."""
    launches = []
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            header, ptx = f.readline(), f.read()
        kernel, rest = header[3:].split(" ", 1)
        consts, opts = rest.rsplit("} {", 1)
        launches.append((kernel, json.loads(consts + "}"), "{" + opts.strip(), instructions(ptx)))
    return launches


def key(kernel: str, consts: dict, opts: str, drop: set[str] = frozenset()) -> str:
    return f"{kernel} {json.dumps({k: v for k, v in consts.items() if k not in drop}, sort_keys=True)} {opts}"


def match(a: list, b: list) -> list[tuple]:
    """Pairs (launch of a or None, launch of b or None): by kernel and constexprs, where a
    constexpr only one side has counts only when it is on."""
    names_a = {k for _, c, _, _ in a for k in c}
    names_b = {k for _, c, _, _ in b for k in c}
    only = names_a ^ names_b

    def loose(launch):
        kernel, consts, opts, _ = launch
        if any(consts[k] for k in only if k in consts):
            return key(kernel, consts, opts)  # a knob that is on: matches nothing in the other
        return key(kernel, consts, opts, only)

    by_key: dict[str, list] = {}
    for y in b:  # launches with equal keys (the same kernel compiled twice) pair in order
        by_key.setdefault(loose(y), []).append(y)
    pairs, used = [], set()
    for x in a:
        ys = by_key.get(loose(x))
        y = ys.pop(0) if ys else None
        pairs.append((x, y))
        if y is not None:
            used.add(id(y))
    pairs += [(None, y) for y in b if id(y) not in used]
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", help="two source trees (default .baseline and .)")
    ap.add_argument("--keep", help="write the PTX here (default: a temporary folder)")
    ap.add_argument("--show", type=int, default=0, help="print up to N lines of each PTX diff")
    args = ap.parse_args()
    trees = args.tree or [".baseline", "."]
    if len(trees) != 2:
        ap.error("give exactly two --tree")
    root = args.keep or tempfile.mkdtemp(prefix="ptx-diff-")
    import triton
    print(f"triton {triton.__version__}, target sm_90; PTX in {root}")
    sides = []
    for i, tree in enumerate(trees):
        out = os.path.join(root, f"tree{i}")
        compile_tree(tree, out)
        sides.append(read_tree(out))
    same = differ = 0
    print(f"| kernel | constexprs | {trees[0]} lines | {trees[1]} lines | PTX |")
    print("|---|---|---|---|---|")
    for x, y in match(*sides):
        kernel, consts = (x or y)[0], (x or y)[1]
        shown = ", ".join(f"{k}={v}" for k, v in consts.items() if k not in ("IEEE", "USE_PDL"))
        na, nb = (len(x[3]) if x else "-"), (len(y[3]) if y else "-")
        if x and y and x[3] == y[3]:
            verdict, same = "same", same + 1
        else:
            verdict, differ = ("differs" if x and y else "only one tree"), differ + 1
        print(f"| {kernel} | {shown} | {na} | {nb} | {verdict} |")
        if verdict == "differs" and args.show:
            diff = list(difflib.unified_diff(x[3], y[3], lineterm="", n=0))
            print("\n".join(diff[:args.show]))
    print(f"{same} same, {differ} not")


if __name__ == "__main__":
    main()
