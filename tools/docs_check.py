"""Checks that the Markdown documentation matches the code.

Each check takes Markdown files and returns its problems as ``"path:line: message"`` strings
(an empty list: the pages pass), so any page can be checked, a bad one included:

- :func:`check_links`: relative links and images resolve, and so do their ``#anchors``
  (headings as GitHub and MkDocs slug them, or ``<a id=...>``); a page under ``docs/`` links
  only inside ``docs/`` (the site is built from that folder alone);
- :func:`check_config_keys`: every dotted config key in code (``train.lr``, ``rollout.remote.urls``)
  exists in the schema, and so does every key of a ```yaml config snippet (:func:`check_yaml_blocks`);
- :func:`check_schema_documented`: every schema key has a description and appears in the pages;
- :func:`check_cli`: every ``plainrl COMMAND [--flag]`` in code is a command and flag of
  ``plainrl.cli.build_parser()``;
- :func:`check_references`: every ``plainrl.x.y`` (or ``plainrl.x.y:name``) imports;
- :func:`check_process_words`: user pages say what the software does, not how it was built;
- :func:`check_code_pointers`: a comment's ``docs/page.md, "Section"`` names a section that exists.

``python tools/docs_check.py [FILE.md ...]`` runs them all (default: README.md and docs/) and
exits 1 on any problem; tests/test_docs.py runs them in ``make test``.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import unicodedata
from pathlib import Path
from typing import Iterable, Iterator

ROOT = Path(__file__).resolve().parents[1]

# the words of how the work was organised, not of what the software does
PROCESS_WORDS = ("session", "sessions", "round", "rounds", "issue", "issues", "goal", "goals", "lent",
                 "milestone", "milestones", "sprint")
_PROCESS_RE = re.compile(r"\b(" + "|".join(PROCESS_WORDS) + r")\b", re.IGNORECASE)
# the same words as technical terms: a POSIX session (setsid)
_TECHNICAL_RE = re.compile(r"\bPOSIX sessions?\b")

_FENCE_RE = re.compile(r"^\s*(```|~~~)")
_LINK_RE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_LINK_RE = re.compile(r"<(?:a|img)\s[^>]*?(?:href|src)=\"([^\"]+)\"", re.IGNORECASE)
_HTML_ID_RE = re.compile(r"<a\s[^>]*?(?:id|name)=\"([^\"]+)\"", re.IGNORECASE)
_HEADING_RE = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN_RE = re.compile(r"(`+)(.+?)\1")
_REFERENCE_RE = re.compile(r"(?<![\w/.-])plainrl(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?")
# file names and paths that look like dotted keys: train.py, data.jsonl, model.safetensors
_FILE_SUFFIXES = {"py", "yaml", "yml", "json", "jsonl", "md", "html", "png", "txt", "csv", "parquet", "arrow",
                  "safetensors", "bin", "gguf", "ipynb", "j2", "toml", "cfg", "sh", "log", "pt", "svg"}


# --- reading pages --------------------------------------------------------------------------


def _lines(path: Path) -> list[tuple[int, str, bool]]:
    """``(line number, text, inside a fenced code block)`` of each line of ``path``."""
    out, fenced = [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE_RE.match(line):
            fenced = not fenced
            out.append((n, line, True))
            continue
        out.append((n, line, fenced))
    return out


def _code(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, code)``: each line of a fenced block and each inline code span."""
    for n, line, fenced in _lines(path):
        if fenced:
            if not _FENCE_RE.match(line):
                yield n, line
        else:
            for m in _CODE_SPAN_RE.finditer(line):
                yield n, m.group(2)


def _prose(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each line outside fenced blocks, inline code spans removed."""
    for n, line, fenced in _lines(path):
        if not fenced:
            yield n, _CODE_SPAN_RE.sub(" ", line)


def _where(path: Path, n: int) -> str:
    try:
        return f"{path.resolve().relative_to(ROOT)}:{n}"
    except ValueError:
        return f"{path}:{n}"


# --- links and anchors ----------------------------------------------------------------------


def slug_github(title: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to ``-``."""
    title = re.sub(r"<[^>]+>", "", title).strip().lower()
    title = re.sub(r"[^\w\- ]", "", title)
    return title.replace(" ", "-")


def slug_mkdocs(title: str) -> str:
    """A heading's anchor as MkDocs' ``toc`` extension makes it (``markdown.extensions.toc.slugify``)."""
    title = re.sub(r"<[^>]+>", "", title)
    title = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode("ascii")
    title = re.sub(r"[^\w\s-]", "", title).strip().lower()
    return re.sub(r"[-\s]+", "-", title)


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown page: each heading's (both slug styles, with GitHub's ``-1``, ``-2``
    for repeated titles) and each ``<a id=...>``."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line, fenced in _lines(path):
        if fenced:
            continue
        found.update(_HTML_ID_RE.findall(line))
        if m := _HEADING_RE.match(line):
            title = _CODE_SPAN_RE.sub(lambda c: c.group(2), m.group(2)).replace("`", "")
            for slug in {slug_github(title), slug_mkdocs(title)}:
                count = seen.get(slug, 0)
                seen[slug] = count + 1
                found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def check_links(paths: Iterable[Path], docs_dir: Path = ROOT / "docs") -> list[str]:
    """Relative links and images of ``paths`` that do not resolve: a missing file, a missing
    ``#anchor`` in a Markdown target, or a page inside ``docs_dir`` linking outside it."""
    problems = []
    docs_dir = docs_dir.resolve()
    for path in paths:
        path = path.resolve()
        for n, line, fenced in _lines(path):
            if fenced:
                continue
            line = _CODE_SPAN_RE.sub(" ", line)
            for target in _LINK_RE.findall(line) + _HTML_LINK_RE.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # https:, mailto:
                    continue
                file_part, _, anchor = target.partition("#")
                dest = (path.parent / file_part).resolve() if file_part else path
                if not dest.exists():
                    problems.append(f"{_where(path, n)}: link to {target!r}: {file_part} does not exist")
                    continue
                if docs_dir in path.parents and docs_dir not in dest.parents and dest != docs_dir:
                    problems.append(f"{_where(path, n)}: link to {target!r} leaves docs/, which the site is built "
                                    "from; name the file in backticks or link its repository URL")
                if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    problems.append(f"{_where(path, n)}: link to {target!r}: no heading or id {anchor!r} in "
                                    f"{dest.name}")
    return problems


# --- configuration keys ---------------------------------------------------------------------


def _is_mapping(annotation: object) -> bool:
    """A field whose value is a free mapping (``task_args``, ``kwargs``): any key under it is the user's."""
    import typing

    # pydantic's FieldInfo.annotation has Annotated[...] stripped: dict[str, Any], or dict[str, Any] | None
    return any(t is dict or typing.get_origin(t) is dict for t in (annotation, *typing.get_args(annotation)))


def _schema() -> tuple[set[str], set[str]]:
    """(every dotted schema key, ``rewards[]`` written ``rewards``; the keys whose value is a free mapping)."""
    from plainrl.config.docgen import sections

    keys, mapping = set(), set()
    for prefix, model in sections():
        for name, field in model.model_fields.items():
            key = (prefix + name).replace("[]", "")
            keys.add(key)
            if _is_mapping(field.annotation):
                mapping.add(key)
    return keys, mapping


def _key_candidates(code: str, keys: set[str]) -> Iterator[str]:
    """Dotted names in ``code`` that are meant as config keys: those whose first two parts name a
    schema field (``train.lr``, ``rollout.remote.urlz``), and any set in an override or YAML
    (``train.lrr=1``); ``model.generate`` or ``model.embed_tokens.weight`` in prose are not keys."""
    sections = {k.split(".")[0] for k in keys if "." in k}
    pattern = r"(?<![\w/.\[-])(" + "|".join(sorted(sections)) + r")((?:\.[A-Za-z_]\w*)+)(?![\w/(-])(\s*[=:])?"
    for m in re.finditer(pattern, code):
        key = m.group(1) + m.group(2)
        if key.rsplit(".", 1)[-1] in _FILE_SUFFIXES:
            continue
        if ".".join(key.split(".")[:2]) in keys or m.group(3):
            yield key


def check_config_keys(paths: Iterable[Path]) -> list[str]:
    """Dotted config keys in the code of ``paths`` (fenced blocks, inline code) that the schema lacks."""
    keys, mapping = _schema()
    problems = []
    for path in paths:
        for n, code in _code(path):
            if "unknown key" in code:  # an error message quoting a wrong key on purpose
                continue
            code = _REFERENCE_RE.sub(" ", code)  # module paths (plainrl.data.tasks) are not keys
            for key in _key_candidates(code, keys):
                if key in keys or any(key.startswith(m + ".") for m in mapping):
                    continue
                hint = [k for k in keys if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
                problems.append(f"{_where(path, n)}: config key {key!r} is not in the schema"
                                + (f" (did you mean {', '.join(sorted(hint))}?)" if hint else ""))
    return problems


def _yaml_blocks(path: Path) -> Iterator[tuple[int, str]]:
    """``(first line number, text)`` of each fenced ```yaml block of ``path``."""
    block: list[str] | None = None
    start = 0
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if block is None and re.match(r"^\s*```ya?ml\s*$", line):
            block, start = [], n + 1
        elif block is not None and _FENCE_RE.match(line):
            yield start, "\n".join(block)
            block = None
        elif block is not None:
            block.append(line)


def _yaml_keys(value: object, prefix: str = "") -> Iterator[str]:
    if isinstance(value, dict):
        for k, v in value.items():
            key = f"{prefix}{k}"
            yield key
            yield from _yaml_keys(v, key + ".")
    elif isinstance(value, list):
        for item in value:
            yield from _yaml_keys(item, prefix)


def check_yaml_blocks(paths: Iterable[Path]) -> list[str]:
    """Keys of the config snippets in ``paths`` (fenced ```yaml blocks, nested mappings) that the
    schema lacks, and blocks that are not YAML."""
    import yaml

    keys, mapping = _schema()
    problems = []
    for path in paths:
        for n, text in _yaml_blocks(path):
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                problems.append(f"{_where(path, n)}: the yaml block does not parse: {str(e).splitlines()[0]}")
                continue
            if not isinstance(data, dict):
                continue
            for key in _yaml_keys(data):
                if key in keys or any(key.startswith(m + ".") for m in mapping):
                    continue
                problems.append(f"{_where(path, n)}: config key {key!r} (in a yaml block) is not in the schema")
    return problems


def check_schema_documented(paths: Iterable[Path]) -> list[str]:
    """Schema keys without a description, or that none of ``paths`` mentions."""
    from plainrl.config.docgen import sections

    text = "\n".join(p.read_text(encoding="utf-8") for p in paths)
    problems = []
    for prefix, model in sections():
        for name, field in model.model_fields.items():
            key = prefix + name
            if not (field.description or "").strip():
                problems.append(f"plainrl/config: {key} has no description (write a docstring under the field)")
            if f"`{key}`" not in text and f"`{key.replace('[]', '')}`" not in text:
                problems.append(f"plainrl/config: {key} is documented on no page (`{key}` appears nowhere)")
    return problems


# --- the command line -----------------------------------------------------------------------

_COMMAND_RE = re.compile(r"(?:^|(?<=[\s`(;&|]))(?<!from )(?<!import )plainrl((?:[ \t]+[^\s#|;&<>`]+)*)")


def _parsers() -> dict[str, object]:
    """``{"train": parser, "cache clear": parser, ...}`` from ``plainrl.cli.build_parser()``."""
    import argparse as ap

    from plainrl.cli import build_parser

    out: dict[str, object] = {}

    def walk(parser: ap.ArgumentParser, prefix: str) -> None:
        for action in parser._actions:
            if isinstance(action, ap._SubParsersAction):
                for name, sub in action.choices.items():
                    out[f"{prefix}{name}".strip()] = sub
                    walk(sub, f"{prefix}{name} ")

    walk(build_parser(), "")
    return out


def check_cli(paths: Iterable[Path]) -> list[str]:
    """``plainrl COMMAND ... --flag`` in the code of ``paths`` naming a command or flag the CLI lacks."""
    parsers = _parsers()
    problems = []
    for path in paths:
        for n, code in _code(path):
            code = re.sub(r"(^|\s)#.*", "", code)  # a shell comment
            for m in _COMMAND_RE.finditer(code):
                words = m.group(1).split()
                if not words or not re.fullmatch(r"[a-z][a-z-]*", words[0]):
                    continue  # `plainrl` alone, `pip install plainrl`, a path
                command = words[0]
                if len(words) > 1 and f"{command} {words[1]}" in parsers:
                    command = f"{command} {words[1]}"
                if command not in parsers:
                    problems.append(f"{_where(path, n)}: `plainrl {words[0]}` is not a command of plainrl "
                                    f"(commands: {', '.join(sorted(c for c in parsers if ' ' not in c))})")
                    continue
                flags = {s for a in parsers[command]._actions for s in a.option_strings}
                for word in words[1:]:
                    flag = word.split("=")[0].strip(".,;:[]")
                    if flag.startswith("-") and flag not in flags and not re.fullmatch(r"-+", flag):
                        problems.append(f"{_where(path, n)}: `plainrl {command}` has no flag {flag} "
                                        f"(flags: {', '.join(sorted(flags))})")
    return problems


# --- Python references ----------------------------------------------------------------------


def _mapped_packages(root: Path = ROOT) -> dict[str, Path]:
    """Packages the wheel maps from another folder (setup.py's ``package_dir``, e.g. ``plainrl.examples``
    from ``examples/``): importable once installed, not from a source checkout."""
    setup = root / "setup.py"
    text = setup.read_text() if setup.exists() else ""
    block = re.search(r"package_dir\s*=\s*\{([^}]*)\}", text)
    return {k: root / v for k, v in re.findall(r"[\"']([\w.]+)[\"']\s*:\s*[\"']([^\"']+)[\"']", block.group(1))} \
        if block else {}


def _resolves(reference: str) -> bool:
    dotted, _, attribute = reference.partition(":")
    for package, folder in _mapped_packages().items():
        if dotted == package or dotted.startswith(package + "."):
            rest = dotted[len(package):].lstrip(".").replace(".", "/")
            return (folder / rest).is_dir() or (folder / f"{rest}.py").is_file() if rest else folder.is_dir()
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        try:
            for part in parts[cut:] + ([attribute] if attribute else []):
                obj = getattr(obj, part)
        except AttributeError:
            return False
        return True
    return False


def check_references(paths: Iterable[Path]) -> list[str]:
    """``plainrl.x.y`` / ``plainrl.x.y:name`` anywhere in ``paths`` that do not import."""
    problems = []
    for path in paths:
        for n, line, _ in _lines(path):
            for ref in _REFERENCE_RE.findall(line):
                ref = ref.rstrip(".")
                if not _resolves(ref):
                    problems.append(f"{_where(path, n)}: {ref} does not import")
    return problems


# --- process words --------------------------------------------------------------------------


def check_process_words(paths: Iterable[Path]) -> list[str]:
    """Lines of ``paths`` (code included) using a word of how the work was organised
    (:data:`PROCESS_WORDS`): user pages state what the software does and measures."""
    problems = []
    for path in paths:
        for n, line, _ in _lines(path):
            for m in _PROCESS_RE.finditer(_TECHNICAL_RE.sub(" ", line)):
                problems.append(f"{_where(path, n)}: {m.group(0)!r}: say what the software does, not how it was "
                                "built (history belongs in CHANGELOG.md, investigations in benchmarks/NOTES.md)")
    return problems


_POINTER_RE = re.compile(r"(?<![\w/.-])(docs/[a-z_]+\.md),\s+\"([^\"]+)\"")


def _headings(path: Path) -> list[str]:
    return [_CODE_SPAN_RE.sub(lambda c: c.group(2), m.group(2)).lower()
            for _, line, fenced in _lines(path) if not fenced and (m := _HEADING_RE.match(line))]


def check_code_pointers(files: Iterable[Path], root: Path = ROOT) -> list[str]:
    """Pointers from code and configs to a page's section, written ``docs/page.md, "Section"``
    (a comment or docstring), whose page or section (a heading starting with that text) is gone."""
    problems = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in _POINTER_RE.finditer(re.sub(r"\s*\n\s*(#\s*)?", " ", text)):
            page, section = root / m.group(1), m.group(2).lower()
            n = text[:text.find(m.group(1))].count("\n") + 1
            if not page.exists():
                problems.append(f"{_where(path, n)}: points to {m.group(1)}, which does not exist")
            elif not any(h.startswith(section) for h in _headings(page)):
                problems.append(f"{_where(path, n)}: points to {m.group(1)}, \"{m.group(2)}\": no such section")
    return problems


def code_files(root: Path = ROOT) -> list[Path]:
    """The package, examples, benchmarks and tests: where code points readers to a page."""
    return sorted(p for d in ("plainrl", "examples", "benchmarks", "tests") for p in (root / d).rglob("*")
                  if p.suffix in (".py", ".yaml") and p.is_file())


def user_pages(root: Path = ROOT) -> list[Path]:
    """README.md and every page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pages", nargs="*", type=Path, help="Markdown files (default: README.md and docs/)")
    args = parser.parse_args(argv)
    pages = args.pages or user_pages()
    problems = (check_links(pages) + check_config_keys(pages) + check_yaml_blocks(pages) + check_cli(pages)
                + check_references(pages)
                + check_process_words(pages)
                + ([] if args.pages else check_schema_documented(pages) + check_code_pointers(code_files())))
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
