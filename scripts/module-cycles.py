#!/usr/bin/env python3
"""Import cycles among each crate's modules: the files of a crate that reach each other through
`use crate::...`, `use super::...` and inline `crate::` paths (test modules left out), grouped
into strongly connected components. Prints every cycle (largest first) with its files, and exits
1 when a cycle has more files than `--max`.

    scripts/module-cycles.py [--max N] [CRATE_DIR ...]   (default: every workspace member)

A path names the deepest module it reaches (`crate::http::chat::Answer` is `http/chat.rs`); a
file imports the files its paths name, never itself.
"""

import argparse
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A test module at the end of a file: its imports are the tests', not the module's.
TESTS = re.compile(r"^#\[cfg\(test\)\]\s*\n\s*mod tests\b", re.M)
# Comments, doc links included: a link is a reference for the reader, not a dependency.
COMMENT = re.compile(r"//.*$", re.M)
USE = re.compile(r"\buse\s+((?:crate|super|self)\b[^;]*);", re.S)
INLINE = re.compile(r"\b((?:crate|super)(?:::[A-Za-z_][A-Za-z0-9_]*)+)")


def modules(src: pathlib.Path) -> dict[tuple[str, ...], pathlib.Path]:
    """Module path -> file, for every module file of the crate rooted at `src`."""
    found = {}
    for path in src.rglob("*.rs"):
        parts = path.relative_to(src).with_suffix("").parts
        if parts == ("main",) and (src / "lib.rs").exists():
            # The binary beside a library: a crate of its own, reaching the library by name.
            key = ("<main>",)
        elif parts in (("lib",), ("main",)):
            key = ()
        elif parts[-1] == "mod":
            key = parts[:-1]
        else:
            key = parts
        found[key] = path
    return found


def expand(tree: str) -> list[str]:
    """`a::{b, c::{d, e}}` -> [`a::b`, `a::c::d`, `a::c::e`]."""
    tree = re.sub(r"\s+", "", tree)
    if "{" not in tree:
        return [tree]
    head, _, rest = tree.partition("{")
    body = rest[: rest.rindex("}")]
    items, depth, start = [], 0, 0
    for i, ch in enumerate(body):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(body[start:i])
            start = i + 1
    items.append(body[start:])
    return [path for item in items if item for path in expand(head + item)]


def resolve(path: str, here: tuple[str, ...], known) -> tuple[str, ...] | None:
    """The deepest known module `path` (as written in module `here`) reaches."""
    parts = [p for p in path.split("::") if p and p != "*"]
    parts = [p.split(" as ")[0] for p in parts]
    if not parts:
        return None
    if parts[0] == "crate":
        base, parts = (), parts[1:]
    else:
        base = here
        while parts and parts[0] in ("super", "self"):
            if parts.pop(0) == "super":
                base = base[:-1]
    full = base + tuple(parts)
    for n in range(len(full), -1, -1):
        if full[:n] in known:
            return full[:n]
    return None


def graph(src: pathlib.Path):
    known = modules(src)
    edges = {key: set() for key in known}
    for key, path in known.items():
        text = path.read_text()
        tests = TESTS.search(text)
        if tests:
            text = text[: tests.start()]
        text = COMMENT.sub("", text)
        # In `foo.rs` (not `foo/mod.rs`), `super` is the parent of `foo`; same for mod.rs.
        paths = [p for use in USE.findall(text) for p in expand(use)]
        paths += INLINE.findall(text)
        for written in paths:
            target = resolve(written, key, known)
            if target is not None and target != key:
                edges[key].add(target)
    return known, edges


def components(edges):
    """Tarjan's strongly connected components."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            out.append(group)

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max", type=int, default=None, help="largest cycle allowed, in files")
    parser.add_argument("crates", nargs="*")
    args = parser.parse_args()
    crates = args.crates or tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]["members"]
    largest = 0
    for crate in crates:
        src = ROOT / crate / "src"
        known, edges = graph(src)
        cycles = sorted((c for c in components(edges) if len(c) > 1), key=len, reverse=True)
        lines = sum(len(p.read_text().splitlines()) for p in known.values())
        print(f"{crate}: {len(known)} files, {lines} lines, largest cycle "
              f"{len(cycles[0]) if cycles else 1} file(s)")
        for cycle in cycles:
            names = sorted(str(known[m].relative_to(src)) for m in cycle)
            print(f"  cycle of {len(cycle)}: {' '.join(names)}")
            largest = max(largest, len(cycle))
    if args.max is not None and largest > args.max:
        print(f"module-cycles: a cycle of {largest} files, more than --max {args.max}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
