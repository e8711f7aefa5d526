#!/usr/bin/env python3
"""Import cycles among one crate's source files: every `use crate::…`/`use super::…` (grouped
uses too) and every inline `crate::a::b`/`super::a` path is an edge from the file to the module
file it names (the longest prefix that is a file). Test files (a `tests.rs`/`tests/` module) and
`#[cfg(test)]` tails are left out. Prints each strongly connected component of more than one file.

    python3 tools/modcycles.py crates/kvroute/src [--layers tools/gateway-layers.txt]

With `--layers FILE`, also checks the file's rules: `layer NAME: MODULE …` names a layer's
modules (as printed here, `gateway::admin`), `forbid A -> B C` says no module of layer A may
import one of B or C, and `cover PREFIX` says every module under PREFIX must be in a layer.
Exits 1 on any cycle or broken rule.
"""
import os, re, sys

args = sys.argv[1:]
layers_file = None
if "--layers" in args:
    i = args.index("--layers")
    layers_file = args[i + 1]
    del args[i : i + 2]
root = args[0].rstrip("/")
mods = {}  # module path tuple -> file
for d, _, fs in os.walk(root):
    for f in fs:
        if not f.endswith(".rs"):
            continue
        p = os.path.join(d, f)
        rel = os.path.relpath(p, root)[:-3].split(os.sep)
        if rel[-1] in ("lib", "main"):
            rel = rel[:-1]
        elif rel[-1] == "mod":
            rel = rel[:-1]
        if "tests" in rel:
            continue
        mods[tuple(rel)] = p


def own_dir_mod(path_tuple, file):
    # a file `a/b.rs` is module (a, b); its `super` is (a,)
    return path_tuple


def resolve(base, parts):
    for k in range(len(parts), 0, -1):
        cand = tuple(base) + tuple(parts[:k])
        if cand in mods:
            return cand
    return tuple(base) if tuple(base) in mods else None


def strip_tests(src):
    m = re.search(r"#\[cfg\(test\)\]\s*mod\s+tests", src)
    return src[: m.start()] if m else src


def expand(prefix, body):
    """`a::{b, c::d}` -> [a::b, a::c::d]"""
    out = []
    body = body.strip()
    if body.startswith("{") and body.endswith("}"):
        depth, cur, items = 0, "", []
        for ch in body[1:-1]:
            if ch == "{": depth += 1
            if ch == "}": depth -= 1
            if ch == "," and depth == 0:
                items.append(cur); cur = ""
            else:
                cur += ch
        items.append(cur)
        for it in items:
            it = it.strip()
            if it:
                out += expand(prefix, it)
        return out
    m = re.match(r"([\w:]*?)::(\{.*\})$", body, re.S)
    if m:
        return expand(prefix + [x for x in m.group(1).split("::") if x], m.group(2))
    return [prefix + [x for x in re.split(r"\s+as\s+", body)[0].split("::") if x]]


edges = {m: set() for m in mods}
for m, p in mods.items():
    src = strip_tests(open(p).read())
    src = re.sub(r"//[^\n]*", "", src)
    paths = []
    for u in re.finditer(r"\buse\s+((?:crate|super|self)(?:::super)*)::(.*?);", src, re.S):
        head, body = u.group(1), u.group(2)
        for path in expand([], body):
            paths.append(head.split("::") + path)
    for u in re.finditer(r"\b((?:crate|super)(?:::super)*)::((?:\w+::)*\w+)", src):
        paths.append(u.group(1).split("::") + u.group(2).split("::"))
    for path in paths:
        if path[0] == "crate":
            base, rest = (), path[1:]
        else:
            # `self` is the module itself (a `mod.rs`/`lib.rs` as much as a file module);
            # each `super` is one level up.
            base = list(m)
            rest = path
            while rest and rest[0] == "super":
                rest = rest[1:]
                base = base[:-1]
            if path[0] == "self":
                base, rest = list(m), path[1:]
        t = resolve(base, rest)
        if t and t != m:
            edges[m].add(t)
    # bare paths into this module's own children (`use config::X;`, `admin::list`)
    for u in re.finditer(r"(?<![\w:])([a-z_][a-z0-9_]*)::", src):
        child = tuple(m) + (u.group(1),)
        if child in mods and child != m:
            edges[m].add(child)

# Tarjan
idx, low, st, on, out, c = {}, {}, [], set(), [], [0]
sys.setrecursionlimit(10000)
def sc(v):
    idx[v] = low[v] = c[0]; c[0] += 1; st.append(v); on.add(v)
    for w in edges[v]:
        if w not in idx:
            sc(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], idx[w])
    if low[v] == idx[v]:
        comp = []
        while True:
            w = st.pop(); on.discard(w); comp.append(w)
            if w == v: break
        if len(comp) > 1:
            out.append(comp)
for v in mods:
    if v not in idx:
        sc(v)
n = sum(len(x) for x in out)
for comp in sorted(out, key=len, reverse=True):
    print(f"cycle of {len(comp)}: " + ", ".join(sorted("::".join(x) or "<root>" for x in comp)))
print(f"{len(mods)} files, {len(out)} cycles, {n} files in cycles")

broken = 0
if layers_file:
    layer_of, forbid, cover = {}, [], []
    for line in open(layers_file):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("layer "):
            name, _, members = line[len("layer "):].partition(":")
            for mod in members.split():
                layer_of[mod] = name.strip()
        elif line.startswith("forbid "):
            a, _, bs = line[len("forbid "):].partition("->")
            forbid.append((a.strip(), set(bs.split())))
        elif line.startswith("cover "):
            cover.append(line[len("cover "):].strip())
        else:
            sys.exit(f"{layers_file}: cannot read {line!r}")
    names = {"::".join(m): m for m in mods}
    for name in sorted(layer_of):
        if name not in names:
            print(f"layers: {name} is listed but no such module")
            broken += 1
    for name in sorted(names):
        if any(name == c or name.startswith(c + "::") for c in cover) and name not in layer_of:
            print(f"layers: {name} is in no layer")
            broken += 1
    for name, m in sorted(names.items()):
        for t in sorted(edges[m]):
            tn = "::".join(t)
            for a, bs in forbid:
                if layer_of.get(name) == a and layer_of.get(tn) in bs:
                    print(f"layers: {name} ({a}) imports {tn} ({layer_of[tn]})")
                    broken += 1
    print(f"{len(layer_of)} modules in layers, {broken} broken rules")
sys.exit(1 if out or broken else 0)
