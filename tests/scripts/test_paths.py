"""The scripts a newcomer and CI run name only what is there, and each build's cache check matches its build.

On a machine whose caches are warm a build script that is never reached, or a path left behind by a rename, goes
unnoticed: every ``--cached`` answers yes and nothing is built. So these tests read the scripts themselves:

- every script, file and directory that ``.ci/run``, ``scripts/*.sh`` and the build scripts invoke by path (and
  every script they reach) exists in the tree: the scripts are parsed, not listed here;
- ``components/build-all.sh`` names every build script under ``components/``, and for each of them the
  directories its ``--bin-dir`` prints are where its ``--cached`` looks, all under ``WEFT_CACHE_ROOT``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENTRY = [ROOT / ".ci" / "run", *sorted((ROOT / "scripts").glob("*.sh")), *sorted((ROOT / "components").rglob("*.sh"))]

# NAME="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)": a directory relative to the script's own.
_SELF_DIR = re.compile(r'^(\w+)="\$\(cd "\$\(dirname "(?:\$\{BASH_SOURCE\[0\]\}|\$0)"\)(/\.\.)?" && pwd\)"', re.M)
# NAME="$OTHER/sub/dir": a path below a variable already known.
_BELOW = re.compile(r'^(\w+)="\$\{?(\w+)\}?(/[^"$]*)"$', re.M)
_HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")
_REDIRECT = re.compile(r"^\d*[<>]+&?")
_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")
_DIRNAME = re.compile(r"\$\(dirname (?:\$\{BASH_SOURCE\[0\]\}|\$0)\)")
_RELATIVE = re.compile(r"^\.{0,2}[\w-][\w.-]*(/[\w.-]*)+$|^\.{1,2}/[\w.-]+")


def _strip_comments(text: str) -> str:
    """The text without comments: a ``#`` that starts a word outside quotes, to the end of its line."""
    out, quote, i = [], "", 0
    while i < len(text):
        c = text[i]
        if quote == "'":
            quote = "" if c == "'" else quote
        elif quote == '"':
            if c == "\\":
                out.append(text[i:i + 2])
                i += 2
                continue
            quote = "" if c == '"' else quote
        elif c in "'\"":
            quote = c
        elif c == "\\":
            out.append(text[i:i + 2])
            i += 2
            continue
        elif c == "#" and (i == 0 or text[i - 1] in " \t\n;("):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _strip_heredocs(text: str) -> str:
    """The text without the bodies of here-documents (a Python program's paths are not the script's)."""
    lines, out, end = text.splitlines(), [], None
    for line in lines:
        if end is not None:
            if line.strip() == end:
                end = None
            continue
        out.append(line)
        m = _HEREDOC.search(line)
        if m:
            end = m.group(1)
    return "\n".join(out)


@dataclass
class Script:
    path: Path
    variables: dict[str, Path] = field(default_factory=dict)
    named: list[tuple[str, Path]] = field(default_factory=list)  # (the word as written, the path it names)

    def resolve(self, word: str, cwd: Path | None) -> Path | None:
        """The path ``word`` names, or None where it is no path of the tree (a Go package, a message, a variable
        this reading cannot know)."""
        word = _REDIRECT.sub("", word.lstrip("(")).rstrip(");|&")
        if (word.startswith("-") and "=" in word) or re.match(r"^\w+=", word):  # --flag=PATH, NAME=PATH
            word = word.split("=", 1)[1]
        word = word.split("::", 1)[0]
        word = re.sub(r"^[\w-]+:(?=\$)", "", word)  # a name before a path: kube:"$HERE/build.sh"
        word = re.sub(r"\[[\w,]+\]$", "", word)  # pip's extras: "$ROOT[test]"
        from_var = bool(_DIRNAME.search(word))
        word = _DIRNAME.sub(str(self.path.parent), word)

        def known(m: re.Match[str]) -> str:
            nonlocal from_var
            name = m.group(1) or m.group(2)
            if name not in self.variables:
                return m.group(0)
            from_var = True
            return str(self.variables[name])

        word = _VAR.sub(known, word)
        if any(c in word for c in "$*`? ") or not word or "://" in word:
            return None
        if word.startswith("/"):
            return Path(os.path.normpath(word)) if from_var else None
        if not _RELATIVE.match(word) or cwd is None:
            return None
        first = word.split("/", 1)[0]
        if "." in first and first not in (".", ".."):
            return None  # a Go package path (k8s.io/..., helm.sh/...)
        return Path(os.path.normpath(cwd / word))


def _words(text: str) -> list[str]:
    lex = shlex.shlex(text.replace("\\\n", " "), posix=True)  # a line continued is one line
    lex.whitespace_split = True
    lex.commenters = ""
    return list(lex)


def read(path: Path) -> Script:
    """Every path the script at ``path`` names, with the directory it names it from."""
    text = path.read_text()
    script = Script(path)
    for m in _SELF_DIR.finditer(text):
        script.variables[m.group(1)] = path.parent.parent if m.group(2) else path.parent
    for m in _BELOW.finditer(text):
        if m.group(2) in script.variables:
            script.variables[m.group(1)] = Path(os.path.normpath(f"{script.variables[m.group(2)]}{m.group(3)}"))
    words = _words(_strip_heredocs(_strip_comments(text)))
    _scan(script, words, cwd=ROOT)
    return script


def _scan(script: Script, words: list[str], cwd: Path | None) -> None:
    i = 0
    while i < len(words):
        word = words[i]
        if word == "cd" and i + 1 < len(words):
            cwd = script.resolve(words[i + 1], cwd)
            i += 2
            continue
        if word == "-c" and i + 1 < len(words) and i > 0 and words[i - 1] in ("bash", "sh"):
            # bash -c 'BODY' $0 $1 ...: the body's positional parameters are the words after it.
            body, args = words[i + 1], words[i + 2:]
            for n, arg in enumerate(args[1:10], start=1):
                body = re.sub(rf"\$(?:\{{{n}\}}|{n})(?!\d)", lambda _m, a=arg: a.replace("\\", "\\\\"), body)
            _scan(script, _words(_strip_comments(body)), cwd)
            i += 2
            continue
        found = script.resolve(word, cwd)
        if found is not None:
            script.named.append((word, found))
        i += 1


def _reachable() -> dict[Path, Script]:
    """Every script the entry points reach by path, read."""
    todo, seen = list(ENTRY), {}
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen[path] = script = read(path)
        todo += [p for _, p in script.named if p.suffix == ".sh" or p.parent.name == ".ci"]
    return seen


def _in_tree(path: Path) -> bool:
    return path.is_relative_to(ROOT) and not path.is_relative_to(ROOT / ".git")


def _ignored(paths: list[Path]) -> set[Path]:
    """Those of ``paths`` git ignores: what the scripts make (.venv/, dist/), not what the tree ships."""
    res = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", "--stdin"], capture_output=True,
                         text=True, input="\n".join(str(p) for p in paths))
    assert res.returncode in (0, 1), res.stderr
    return {Path(line) for line in res.stdout.splitlines()}


def test_every_path_the_scripts_invoke_exists() -> None:
    scripts = _reachable()
    absent = [(s, word, p) for s in scripts.values() for word, p in s.named if _in_tree(p) and not p.exists()]
    made = _ignored([p for _, _, p in absent])
    missing = [f"{s.path.relative_to(ROOT)}: {word} -> {p.relative_to(ROOT)}" for s, word, p in absent if p not in made]
    assert not missing, "paths the scripts name that are not in the tree:\n  " + "\n  ".join(missing)


def test_the_reading_finds_what_the_scripts_run() -> None:
    """The parser above must see the calls it exists for; a reading that found nothing would pass anything."""
    scripts = _reachable()
    named = {p.relative_to(ROOT).as_posix() for s in scripts.values() for _, p in s.named if _in_tree(p)}
    for want in ("scripts/setup.sh", "scripts/test.sh", "components/build-all.sh", "components/helm/build.sh",
                 "components/buildlib.sh", "harness/nodes/rootfs.sh", "integration/cri/test_critest.py",
                 "components/dra/gpudriver", "pyproject.toml"):
        assert want in named, f"{want} not found among the paths the scripts name"


def test_a_stale_path_in_a_background_build_is_caught(tmp_path: Path) -> None:
    """The shape that hid the renamed builds: ``bash -c '... "$1/kube/build.sh" ...' _ "$ROOT"``."""
    stale = tmp_path / "setup.sh"
    stale.write_text('#!/usr/bin/env bash\nROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"\n'
                     "setsid nice -n 19 bash -c 'bash \"$1/kube/build.sh\" >\"$2/kube-build.log\" 2>&1\n"
                     "  bash \"$1/components/helm/build.sh\"' _ \"$ROOT\" \"$ROOT/.venv/log\" &\n")
    named = [str(p) for _, p in read(stale).named]
    assert str(tmp_path.parent / "kube" / "build.sh") in named
    assert str(tmp_path.parent / "components" / "helm" / "build.sh") in named


def _builds() -> list[Path]:
    """The scripts components/build-all.sh runs, in its order."""
    path = ROOT / "components" / "build-all.sh"
    body = re.search(r"^BUILDS=\(([^)]*)\)", path.read_text(), re.M)
    assert body, f"{path} has no BUILDS=(...) list"
    script = read(path)
    return [found for word in _words(body.group(1)) if (found := script.resolve(word, None))]


def test_build_all_names_every_build_script() -> None:
    listed = set(_builds())
    scripts = set((ROOT / "components").glob("build.sh")) | set((ROOT / "components").glob("*/build.sh"))
    assert scripts - listed == set(), "build scripts components/build-all.sh does not run"
    assert all(p.is_file() for p in listed)


@pytest.mark.parametrize("script", _builds(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_each_build_s_cache_check_looks_where_it_builds(script: Path, tmp_path: Path) -> None:
    env = {**os.environ, "WEFT_CACHE_ROOT": str(tmp_path)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=60)

    assert run("--cached").returncode == 1, "an empty cache root is reported built"
    dirs = [Path(line) for line in run("--bin-dir").stdout.split()]
    assert dirs, "--bin-dir printed nothing"
    for d in dirs:
        assert d.is_relative_to(tmp_path), f"{d} is not under WEFT_CACHE_ROOT={tmp_path}"
        d.mkdir(parents=True)
        (d / ".complete").touch()
    res = run("--cached")
    assert res.returncode == 0, f"built where --bin-dir says, yet --cached says no: {res.stderr}"
