"""Finds cycles between the files of each crate's module tree (rustc allows them; the layout forbids them).

A file depends on another when it names an item there: `crate::a::b::Item`, `super::x`,
`super::super::x`, each leaf of a use-tree (`crate::{a::{B, c::D}, e}`), or a path through a parent
module's `pub use child::Item` re-export, which is followed to the child's file. A parent's
`mod child;` is not an edge (declaring is not depending), nor is a `#[cfg(test)]` module (its
body, or its file). An inline module (`mod inner { … }`, not a test's) is read as part of its
file: its `super` is taken as the file's.
Prints every strongly connected component of more than one file and exits 1 if there is one.

    python3 scripts/check/module_cycles.py          # the repository's crates
    python3 scripts/check/module_cycles.py DIR      # the crates under DIR (DIR/src, DIR/*/src)
"""
import re
import sys
from pathlib import Path

ROOT = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else Path(__file__).resolve().parents[2]
CRATES = [ROOT / "src"] + sorted(p.parent / "src" for p in ROOT.glob("*/Cargo.toml"))


def closing(text, i):
    """The index just past the brace that closes the one at `i`."""
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return j + 1
    return len(text)


def split_top(text, sep=","):
    """`text` split at the `sep`s outside braces."""
    parts, depth, start = [], 0, 0
    for j, c in enumerate(text):
        depth += {"{": 1, "}": -1}.get(c, 0)
        if c == sep and depth == 0:
            parts.append(text[start:j])
            start = j + 1
    return parts + [text[start:]]


def leaves(tree):
    """Every path a use-tree names: `a::{b, c::{d, e}}` gives [a, b], [a, c, d], [a, c, e]."""
    tree = tree.strip()
    if not tree:
        return []
    if tree.startswith("{"):
        return [p for part in split_top(tree[1:-1]) for p in leaves(part)]
    m = re.match(r"(\w+)\s*(?:::\s*(.*))?$", tree, re.S)
    if not m:
        return []
    if m.group(2) is None:
        return [[m.group(1)]]
    if m.group(2).strip() == "*":
        return [[m.group(1), "*"]]
    rest = leaves(m.group(2))
    return [[m.group(1)] + r if r != ["self"] else [m.group(1)] for r in rest] or [[m.group(1)]]


def item_paths(text):
    """(`crate` or `super`, the segments after it) for every path that starts at one of them."""
    out = []
    for m in re.finditer(r"\b(crate|super)\s*::\s*", text):
        if m.start() and text[m.start() - 1] == ":":
            continue  # `super::super::x`: its first `super` starts the path
        i = m.end()
        tail = re.match(r"(?:\w+\s*::\s*)*(?:\{|\w+)", text[i:])
        if not tail:
            continue
        end = i + tail.end()
        if text[end - 1] == "{":
            end = closing(text, end - 1)
        for segs in leaves(text[i:end]):
            if segs and segs[0] not in ("self",):
                out.append((m.group(1), [s for s in segs if s != "self"]))
    return out


def strip(text):
    """The source without comments, string and char literals, and its #[cfg(test)] module."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            i = text.find("\n", i) % (n + 1)
        elif text.startswith("/*", i):
            i = text.find("*/", i) + 2 if text.find("*/", i) >= 0 else n
        elif c == "r" and re.match(r'r#*"', text[i:]) and not re.search(r'(\w(?<![bc])|\w[bc])$', text[max(0, i - 2):i]):
            hashes = re.match(r'r(#*)"', text[i:]).group(1)
            close = text.find('"' + hashes, i + len(hashes) + 2)
            i = close + 1 + len(hashes) if close >= 0 else n
            out.append('""')
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            out.append('""')
        elif c == "'" and re.match(r"'(\\.[^']*|[^\\'])'", text[i:]):
            i += len(re.match(r"'(\\.[^']*|[^\\'])'", text[i:]).group(0))
            out.append("' '")
        else:
            out.append(c)
            i += 1
    text = "".join(out)
    # Each #[cfg(test)] module's body (or its `mod tests;`, whose file is left out), keeping what
    # follows it.
    tests = []
    test_mod = r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*([{;])"
    while m := re.search(test_mod, text):
        end = closing(text, m.end() - 1) if m.group(2) == "{" else m.end()
        if m.group(2) == ";":
            tests.append(m.group(1))
        text = text[: m.start()] + text[end:]
    return text, tests


def module_of(src, path):
    rel = path.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def main():
    found = []
    for src in CRATES:
        if not src.is_dir():
            continue
        files = {}
        for path in src.rglob("*.rs"):
            if path.name == "main.rs" and path.parent == src and (src / "lib.rs").exists():
                continue  # the binary: a crate of its own over the library
            if "bin" in path.relative_to(src).parts:
                continue
            files[module_of(src, path)] = path
        texts, tests = {}, []
        for m, p in files.items():
            texts[m], declared = strip(p.read_text())
            tests += [m + (t,) for t in declared]
        for t in tests:
            files.pop(t, None)
            texts.pop(t, None)

        def module(m, segs):
            """The file of the deepest module `segs` names, read from module `m`."""
            base = m
            if segs and segs[0] == "crate":
                base, segs = (), segs[1:]
            elif segs and segs[0] == "self":
                segs = segs[1:]
            while segs and segs[0] == "super":
                base, segs = base[:-1], segs[1:]
            for s in segs:
                if base + (s,) not in files:
                    break
                base = base + (s,)
            return base

        # Where a module's names come from: each leaf of a `pub use` tree (`pub use child::{A, B
        # as C}`, `pub use crate::a::x::D`, `pub use child::*`), by the name it is used under.
        named, globs = {}, {}
        for m, text in texts.items():
            for tree in re.findall(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]*);", text):
                tree = re.sub(r"(\w+)\s+as\s+(\w+)", r"\1__as__\2", tree)
                for segs in leaves(tree):
                    *path, last = segs
                    if last == "*":
                        globs.setdefault(m, []).append(module(m, path))
                        continue
                    item, _, alias = last.partition("__as__")
                    named.setdefault(m, {})[alias or item] = module(m, path + [item])

        def defines(m, name):
            return re.search(rf"\b(struct|enum|fn|type|const|static|trait|mod)\s+{name}\b", texts[m])

        def resolve(segments):
            """The file an item path names: the deepest module file, or the child a parent re-exports it from."""
            mod = ()
            for s in segments:
                if mod + (s,) in files:
                    mod = mod + (s,)
                    continue
                target = named.get(mod, {}).get(s)
                if target is None:
                    target = next((c for c in globs.get(mod, []) if c in files and defines(c, s)), None)
                return target if target in files else mod
            return mod

        edges = {m: set() for m in files}
        for m, text in texts.items():
            for head, segs in item_paths(re.sub(r"\s+as\s+\w+", "", text)):
                base = list(m[:-1]) if head == "super" else []
                while segs and segs[0] == "super":
                    base, segs = base[:-1], segs[1:]
                target = resolve(base + segs)
                # A child naming what its parent module holds is not counted: the parent is the
                # module's face, and its children are its parts.
                if target != m and m[: len(target)] != target:
                    edges[m].add(target)
        # Every level of the tree: a module's children, each with all beneath it, must not form
        # a cycle either (two files can be acyclic while their directories depend on each other).
        depth = max(len(m) for m in files)
        for d in range(1, depth + 1):
            level = {}
            for m, targets in edges.items():
                for t in targets:
                    a, b = m[:d], t[:d]
                    if len(m) >= d and len(t) >= d and a != b and a[:-1] == b[:-1]:
                        level.setdefault(a, set()).add(b)
                        level.setdefault(b, set())
            for comp in sccs(level):
                if len(comp) > 1 and (src, sorted(comp)) not in [(s, sorted(c)) for s, c, _ in found]:
                    found.append((src, comp, level))
    for src, comp, edges in found:
        names = sorted("/".join(m) for m in comp)
        print(f"{src.relative_to(ROOT)}: cycle among {', '.join(names)}")
        for m in sorted(comp):
            for t in sorted(edges[m] & set(comp)):
                print(f"    {'/'.join(m) or 'lib'} -> {'/'.join(t) or 'lib'}")
    if not found:
        print(f"no module cycles in {len(CRATES)} crates")
    return 1 if found else 0


def sccs(edges):
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
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


if __name__ == "__main__":
    sys.exit(main())
