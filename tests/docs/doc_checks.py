"""Checks the commands, code and references a Markdown page shows against the code, without running heavy work.

What is checked, per fenced block (every fence must name its language; ```text for output and trees):

- `bash` / `sh` / `shell` / `console` blocks (`console`: only the `$ ` lines are commands): each command is split
  into words as the shell would (comments, quotes, `\\` continuations, `&&`, `;`, `|`). `bridge` (also
  `hf-mcore-bridge`, `python -m hf_mcore_bridge.cli.main`, the same under `torchrun -m`): the sub-command exists and
  every option shown is in that sub-command's `--help`; a value of an option with choices is one of them, an `<int>`
  value an integer, the number of arguments within what the command takes, its required options given; a
  `bridge train grpo` override `key=value` names a field of the run's config. `python -m MODULE` / `python FILE`
  and `torchrun`: the module or file exists, and every option shown is in its `--help` (run only when it has an
  argument parser: a script that reads `sys.argv` itself is never run). `bash FILE` / `sbatch FILE`: the file
  exists. `pip install` of this project's extras: the extras exist. Words that name a repository path
  (`examples/...`, `scripts/...`, `tests/...`, `docs/...`) exist.
- A block marked for GPU or multi-node machines (the line `<!-- gpu -->` just before it, or `gpu` in its info
  string) is checked only for its sub-commands, options, override keys and repository paths: its option values
  and the number of its arguments are the GPU machine's business.
- `python` blocks are compiled, and every `hf_mcore_bridge` import is resolved: the module exists and each name
  taken from it is defined there, read from the source (a re-export is followed to its definition).

And in the prose: every inline-code path of a repository file (`grpo/refit/stream.py` is looked up under the
package too) exists, every `hf_mcore_bridge.x.y` reference names a module or a name defined in one, every dotted key
of the run's config (`grpo.max_token_mult_prob_error`, `logger.wandb.{project,name}`) is a field, and every
relative link points at a file.

`--help` outputs are cached: one subprocess per command, whatever the number of pages.
"""

from __future__ import annotations

import ast
import collections.abc
import dataclasses
import functools
import os
import re
import shlex
import subprocess
import sys
import tomllib
import typing
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {"hf_mcore_bridge.cli": REPO / "cli", "hf_mcore_bridge.mappings": REPO / "mappings"}
"""Where `pyproject.toml` installs the packages that live outside `hf_mcore_bridge/`."""
SHELL_LANGS = {"bash", "sh", "shell", "console"}
PYTHON_LANGS = {"python", "py"}
GPU_MARK = "<!-- gpu -->"
REPO_PREFIXES = ("examples/", "scripts/", "tests/", "docs/", "cli/", "mappings/", "hf_mcore_bridge/")
BRIDGE_NAMES = {"bridge", "hf-mcore-bridge"}
BRIDGE_MODULE = "hf_mcore_bridge.cli.main"
PLAIN_COMMANDS = {"cd", "export", "source", ".", "ruff", "git", "mkdocs", "nvidia-smi", "echo", "ls", "cat"}
"""Commands shown in the docs that name nothing of this project to check."""
SHELL_OPERATORS = {"&&", "||", ";", "|", "&", "(", ")"}
FILE_SUFFIXES = {"py", "sh", "yaml", "yml", "md", "json", "jsonl", "toml", "sbatch", "pkl", "pt", "txt", "safetensors"}


@dataclass(frozen=True)
class Block:
    """A fenced code block of a page."""

    page: str
    line: int
    lang: str
    gpu: bool
    text: str

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def fenced_blocks(text: str, page: str) -> tuple[list[Block], list[str]]:
    """The page's fenced blocks, and an error for each fence that names no language."""
    blocks, errors = [], []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        opening = re.match(r"^ {0,3}(`{3,}|~{3,})\s*(.*)$", lines[index])
        if not opening:
            index += 1
            continue
        fence, info = opening.group(1), opening.group(2).split()
        start = index + 1
        end = start
        while end < len(lines) and not re.match(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        previous = next((line.strip() for line in reversed(lines[:index]) if line.strip()), "")
        if not info:
            errors.append(f"{page}:{index + 1}: a fenced block names no language (```text for output)")
        else:
            gpu = "gpu" in info[1:] or previous == GPU_MARK
            blocks.append(Block(page, index + 1, info[0].lower(), gpu, "\n".join(lines[start:end])))
        index = end + 1
    return blocks, errors


def without_blocks(text: str) -> str:
    """The page's prose: fenced blocks blanked out (line numbers kept)."""
    out, fence = [], None
    for line in text.splitlines():
        opening = re.match(r"^ {0,3}(`{3,}|~{3,})", line)
        if fence is None and opening:
            fence = opening.group(1)
            out.append("")
        elif fence is not None:
            if re.match(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$", line):
                fence = None
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


# Shell -------------------------------------------------------------------------------------------------------------


def shell_commands(block: Block) -> Iterator[list[str]]:
    """Each simple command of a shell block as its words (environment assignments in front dropped)."""
    lines = block.text.splitlines()
    if block.lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    for line in joined.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        for word in lexer:
            if word in SHELL_OPERATORS:
                yield from _without_assignments(words)
                words = []
            else:
                words.append(word)
        yield from _without_assignments(words)


def _without_assignments(words: list[str]) -> Iterator[list[str]]:
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]
    if words:
        yield words


@dataclass(frozen=True)
class Option:
    """An option as a command's `--help` lists it."""

    takes_value: bool
    """It takes a value (its help shows a metavar)."""
    choices: tuple[str, ...] | None
    """The values it accepts, where its help lists them (`<mcore|hf>`, `{spawn,fork}`)."""
    kind: str | None
    """`int` or `float` where its value must be a number."""
    required: bool


@dataclass(frozen=True)
class Help:
    """What a command's `--help` says it takes."""

    options: dict[str, Option]
    arguments: tuple[tuple[str, bool, bool], ...]
    """(name, required, variadic) of each positional argument (click's help only)."""
    commands: tuple[str, ...]
    """Its sub-commands (a command group)."""


def _entries(section: list[str]) -> list[str]:
    """A help section's entries: a line at two spaces' indent starts one, deeper lines continue it."""
    entries: list[str] = []
    for line in section:
        if re.match(r"^ {2}\S", line):
            entries.append(line.strip())
        elif entries and line.strip():
            entries[-1] += " " + line.strip()
    return entries


def _sections(text: str) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        header = re.match(r"^([A-Za-z][A-Za-z ]*):\s*$", line)
        if header:
            current = header.group(1).lower()
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    return sections


def parse_help(text: str) -> Help:
    """Options (click's and argparse's layouts), positional arguments and sub-commands of a `--help` text."""
    sections = _sections(text)
    options: dict[str, Option] = {}
    for entry in _entries(sections.get("options", [])):
        signature = re.split(r"\s{2,}", entry)[0]
        required = "[required]" in entry
        for piece in re.split(r",\s+|\s+/\s+", signature):
            flag, _, metavar = piece.partition(" ")
            if not flag.startswith("-"):
                continue
            choices = re.fullmatch(r"<([^>]*\|[^>]*)>|\{([^}]*)\}", metavar)
            options[flag] = Option(
                takes_value=bool(metavar),
                choices=tuple(re.split(r"[|,]", choices.group(1) or choices.group(2))) if choices else None,
                kind=metavar.strip("<>") if metavar in ("<int>", "<float>") else None,
                required=required,
            )
    arguments = []
    for entry in _entries(sections.get("arguments", [])):
        name = entry.split()[0]
        arguments.append((name.rstrip("."), "[required]" in entry, name.endswith("...")))
    commands = tuple(entry.split()[0] for entry in _entries(sections.get("commands", [])))
    return Help(options, tuple(arguments), commands)


@functools.cache
def help_text(*command: str) -> str:
    """`command --help`, run once (cached): one subprocess per command whatever the number of pages."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    done = subprocess.run(
        [*command, "--help"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} --help failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    return done.stdout


@functools.cache
def torchrun_help() -> Help:
    """torchrun's options, from its own argument parser (torch is loaded anyway: no subprocess to start it again)."""
    from torch.distributed.run import get_args_parser

    return parse_help(get_args_parser().format_help())


def bridge_help(*path: str) -> Help:
    """`bridge PATH --help`, parsed."""
    _fetch_every_bridge_help()
    return parse_help(_bridge_help_text(path))


def _bridge_help_text(path: tuple[str, ...]) -> str:
    return help_text(sys.executable, "-m", BRIDGE_MODULE, *path)


@functools.cache
def _fetch_every_bridge_help() -> None:
    """Every sub-command's `--help` at once, the subprocesses side by side (then cached by `help_text`)."""
    top = parse_help(_bridge_help_text(()))
    with ThreadPoolExecutor(max_workers=8) as pool:
        helps = [parse_help(text) for text in pool.map(lambda name: _bridge_help_text((name,)), top.commands)]
        subs = [(group, sub) for group, help in zip(top.commands, helps, strict=True) for sub in help.commands]
        list(pool.map(_bridge_help_text, subs))


class ShellChecker:
    """Checks one shell block's commands; `errors` collects one line per problem."""

    def __init__(self, block: Block):
        self.block = block
        self.errors: list[str] = []

    def fail(self, words: list[str], problem: str) -> None:
        shown = " ".join(words)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        self.errors.append(f"{self.block.where()}: `{shown}`: {problem}")

    def check(self) -> list[str]:
        for words in shell_commands(self.block):
            self.command(words)
        return self.errors

    def command(self, words: list[str]) -> None:
        program = words[0]
        self.repo_paths(words)
        if program in BRIDGE_NAMES:
            self.bridge(words, words[1:])
        elif program in ("python", "python3") or program.endswith("/python"):
            self.python(words, words[1:])
        elif program == "torchrun":
            self.torchrun(words, words[1:])
        elif program in ("bash", "sh", "sbatch"):
            if len(words) < 2 or (not (REPO / words[1]).is_file() and not words[1].startswith(REPO_PREFIXES)):
                self.fail(words, f"{program}: no such file in the repository")
        elif program == "pip":
            self.pip(words, words[1:])
        elif program == "pytest":
            pass  # its test paths are repository paths, checked above
        elif program not in PLAIN_COMMANDS:
            self.fail(words, f"unknown command {program!r} (teach tests/docs/doc_checks.py what to check of it)")

    def repo_paths(self, words: list[str]) -> None:
        for word in words:
            path = word.split("=", 1)[-1]
            if path.startswith(REPO_PREFIXES) and not (REPO / path).exists():
                self.fail(words, f"{path}: no such path in the repository")

    # python, torchrun, pip ---------------------------------------------------------------------------------------

    def python(self, words: list[str], args: list[str]) -> None:
        if args[:1] == ["-m"] and len(args) > 1:
            self.module(words, args[1], args[2:])
        elif args and args[0].endswith(".py"):
            self.script(words, args[0], args[1:])
        elif args[:1] != ["-c"]:
            self.fail(words, "python: expected `-m MODULE` or a script")

    def module(self, words: list[str], module: str, args: list[str]) -> None:
        if module == BRIDGE_MODULE:
            self.bridge(words, args)
        elif module == "pip":
            self.pip(words, args)
        elif module == "pytest":
            pass  # test paths are repository paths
        else:
            source = module_source(module)
            if source is None:
                self.fail(words, f"no module {module}")
            elif any(a.startswith("-") for a in args):
                self.argparse_options(words, source, (sys.executable, "-m", module), args)

    def script(self, words: list[str], script: str, args: list[str]) -> None:
        path = REPO / script
        if not path.is_file():
            if not script.startswith(REPO_PREFIXES):  # else reported as a missing repository path
                self.fail(words, f"{script}: no such script")
        elif any(a.startswith("-") for a in args):
            self.argparse_options(words, path, (sys.executable, str(path)), args)

    def argparse_options(self, words: list[str], source: Path, command: tuple[str, ...], args: list[str]) -> None:
        if not re.search(r"ArgumentParser|typer|click", source.read_text()):
            self.fail(words, f"{source.name} has no option parser to check {args} against")
            return
        options = parse_help(help_text(*command)).options
        for arg in args:
            flag = arg.split("=", 1)[0]
            if flag.startswith("-") and flag not in options:
                self.fail(words, f"{flag}: not an option of {source.name} (its --help)")

    def torchrun(self, words: list[str], args: list[str]) -> None:
        options = torchrun_help().options
        index, as_module = 0, False
        while index < len(args) and args[index].startswith("-"):
            flag = args[index].split("=", 1)[0]
            option = options.get(flag)
            if option is None:
                self.fail(words, f"{flag}: not an option of torchrun")
                return
            as_module = as_module or flag in ("-m", "--module")
            index += 1 if "=" in args[index] or not option.takes_value else 2
        if index >= len(args):
            self.fail(words, "torchrun: no script or module to run")
        elif as_module:
            self.module(words, args[index], args[index + 1 :])
        else:
            self.script(words, args[index], args[index + 1 :])

    def pip(self, words: list[str], args: list[str]) -> None:
        extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
        for arg in args:
            named = re.match(r"^(?:hf-mcore-bridge|\.|-e\s*\.)\[([^\]]*)\]", arg)
            for extra in named.group(1).split(",") if named else ():
                if extra.strip() not in extras:
                    self.fail(words, f"no extra {extra.strip()!r} in pyproject.toml (there are: {sorted(extras)})")

    # bridge --------------------------------------------------------------------------------------------------------

    def bridge(self, words: list[str], args: list[str]) -> None:
        top = bridge_help()
        index = self.leading_options(words, args, top)
        if index is None:
            return
        if index >= len(args):
            if not any(a in ("--help", "-h", "--version") for a in args):
                self.fail(words, "bridge: no sub-command")
            return
        path = [args[index]]
        if path[0] not in top.commands:
            self.fail(words, f"no sub-command `bridge {path[0]}` (there are: {', '.join(top.commands)})")
            return
        command = bridge_help(*path)
        rest = args[index + 1 :]
        while command.commands:
            if not rest or rest[0] not in command.commands:
                given = rest[0] if rest else "nothing"
                self.fail(words, f"`bridge {' '.join(path)}` takes one of {command.commands}, not {given}")
                return
            path.append(rest[0])
            command, rest = bridge_help(*path), rest[1:]
        self.command_args(words, path, command, rest)

    def leading_options(self, words: list[str], args: list[str], top: Help) -> int | None:
        index = 0
        while index < len(args) and args[index].startswith("-"):
            if args[index] not in top.options:
                self.fail(words, f"{args[index]}: not an option of `bridge` itself")
                return None
            index += 1
        return index

    def command_args(self, words: list[str], path: list[str], command: Help, args: list[str]) -> None:
        name = "bridge " + " ".join(path)
        positionals, given = [], set()
        index = 0
        while index < len(args):
            arg = args[index]
            if not arg.startswith("-") or arg == "-":
                positionals.append(arg)
                index += 1
                continue
            flag, has_value, value = arg.partition("=")
            option = command.options.get(flag)
            if option is None:
                self.fail(words, f"{flag}: not an option of `{name}` (its --help)")
                return  # what follows cannot be told apart from its value
            given.add(flag)
            if option.takes_value and not has_value:
                index += 1
                value = args[index] if index < len(args) else ""
            if not self.block.gpu:
                self.option_value(words, name, flag, option, value)
            index += 1
        if path == ["train", "grpo"]:
            for override in positionals:
                self.config_override(words, override)
        if not self.block.gpu and "--help" not in given and "-h" not in given:
            self.arity(words, name, command, positionals, given)

    def option_value(self, words: list[str], name: str, flag: str, option: Option, value: str) -> None:
        if "$" in value:
            return  # the shell's value
        if option.choices and value not in option.choices:
            self.fail(words, f"{name} {flag} {value}: not one of {'|'.join(option.choices)}")
        if option.kind == "int" and not re.fullmatch(r"-?\d+", value):
            self.fail(words, f"{name} {flag} {value}: not an integer")
        if option.kind == "float":
            try:
                float(value)
            except ValueError:
                self.fail(words, f"{name} {flag} {value}: not a number")

    def arity(self, words: list[str], name: str, command: Help, positionals: list[str], given: set[str]) -> None:
        required = sum(1 for _, needed, _ in command.arguments if needed)
        variadic = any(many for _, _, many in command.arguments)
        if len(positionals) < required or (not variadic and len(positionals) > len(command.arguments)):
            takes = f"{required}-{len(command.arguments)}" if not variadic else f"at least {required}"
            self.fail(words, f"`{name}` takes {takes} arguments, not {len(positionals)}")
        for flag, option in command.options.items():
            if option.required and flag not in given:
                self.fail(words, f"`{name}` needs {flag}")

    def config_override(self, words: list[str], override: str) -> None:
        key, sep, _ = override.partition("=")
        if not sep:
            self.fail(words, f"{override}: an override is key.sub=value")
        elif (problem := config_key_problem(key)) is not None:
            self.fail(words, problem)


# The run's config ------------------------------------------------------------------------------------------------


def config_key_problem(dotted: str) -> str | None:
    """None where `dotted` names a field of the GRPO run's config (or a key inside a section it forwards as a
    mapping, such as `policy.megatron_cfg.transformer`), else what is wrong."""
    from hf_mcore_bridge.grpo.run.config import GRPOConfig

    node: typing.Any = GRPOConfig
    for depth, part in enumerate(dotted.split(".")):
        if node is dict:
            return None
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return f"{dotted}: {'.'.join(dotted.split('.')[:depth])} holds no keys"
        hints = typing.get_type_hints(node)
        if part not in hints:
            return f"{dotted}: no config key {part!r} in {node.__name__} (there are: {', '.join(hints)})"
        node = _section_type(hints[part])
    return None


def _section_type(hint: typing.Any) -> typing.Any:
    """The dataclass a field holds, `dict` for a mapping, else the hint itself (a leaf)."""
    origin = typing.get_origin(hint)
    if origin in (dict, collections.abc.Mapping) or hint is dict:
        return dict
    for arg in typing.get_args(hint):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg):
            return arg
    return hint


def config_sections() -> set[str]:
    from hf_mcore_bridge.grpo.run.config import GRPOConfig

    return {field.name for field in dataclasses.fields(GRPOConfig)}


# Python ----------------------------------------------------------------------------------------------------------


def module_source(module: str) -> Path | None:
    """The file of a module of this project (without importing it), or, for another, whether Python finds it."""
    if module.split(".")[0] == "hf_mcore_bridge":
        for package, directory in sorted(PACKAGE_DIRS.items(), key=lambda item: -len(item[0])):
            if module == package or module.startswith(package + "."):
                relative = module[len(package) :].lstrip(".").split(".")
                return _module_file(directory, relative)
        return _module_file(REPO / "hf_mcore_bridge", module.split(".")[1:])
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


def _module_file(directory: Path, parts: list[str]) -> Path | None:
    path = directory.joinpath(*[p for p in parts if p])
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def check_python(block: Block) -> list[str]:
    """Compiles the block and resolves its `hf_mcore_bridge` imports: each module exists, and each name taken from
    one is defined there (or re-exported from where it is), read from the source without importing it."""
    try:
        tree = ast.parse(block.text, filename=block.where())
        compile(tree, block.where(), "exec")
    except SyntaxError as err:
        return [f"{block.where()}: does not compile: {err.msg} (block line {err.lineno})"]
    errors = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hf_mcore_bridge" and module_source(alias.name) is None:
                    errors.append(f"{block.where()}: import {alias.name}: no such module")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("hf_mcore_bridge"):
            module = typing.cast(str, node.module)
            if module_source(module) is None:
                errors.append(f"{block.where()}: from {module}: no such module")
                continue
            for alias in node.names:
                if reference_problem(f"{module}.{alias.name}") is not None:
                    errors.append(f"{block.where()}: from {module} import {alias.name}: no such name")
    return errors


# Prose -----------------------------------------------------------------------------------------------------------


def inline_codes(prose: str) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(prose.splitlines(), start=1):
        for match in re.finditer(r"(`+)(.+?)\1", line):
            yield number, match.group(2).strip()


def _expand_braces(text: str) -> list[str]:
    match = re.search(r"\{([^{}]*,[^{}]*)\}", text)
    if not match:
        return [text]
    return [
        expanded
        for choice in match.group(1).split(",")
        for expanded in _expand_braces(text[: match.start()] + choice.strip() + text[match.end() :])
    ]


def check_prose(text: str, page: str, base: Path) -> list[str]:
    """Inline-code paths, module references and config keys, and relative links, of a page's prose."""
    errors = []
    prose = without_blocks(text)
    sections = config_sections()
    for number, code in inline_codes(prose):
        where = f"{page}:{number}"
        token = code.split()[0] if code.split() else ""
        if token.startswith("hf_mcore_bridge.") and re.fullmatch(r"[\w.]+", token):
            if problem := reference_problem(token):
                errors.append(f"{where}: `{token}`: {problem}")
        elif (key := config_key_of(token)) is not None and key.split(".")[0] in sections:
            for expanded in _expand_braces(key):
                if config_key_problem(expanded) and reference_problem(f"hf_mcore_bridge.{expanded}"):
                    errors.append(f"{where}: `{expanded}`: {config_key_problem(expanded)}")
        if (problem := path_problem(token, base)) is not None:
            errors.append(f"{where}: `{token}`: {problem}")
    for number, line in enumerate(prose.splitlines(), start=1):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            if not (base / target.split("#")[0]).exists():
                errors.append(f"{page}:{number}: link to {target}: no such file")
    return errors


def config_key_of(token: str) -> str | None:
    """The dotted key an inline code names (`grpo.seed=3`, `generation.precision: fp8`), or None: not a key (a file
    name such as `policy.py` is none)."""
    key = re.split(r"[=:<>\s]", token)[0].rstrip(".,")
    if "." not in key or not re.fullmatch(r"[\w.{},]+", key) or key.rsplit(".", 1)[-1] in FILE_SUFFIXES:
        return None
    return key


def path_problem(token: str, base: Path) -> str | None:
    """None unless `token` is a path under one of the repository's directories (or the package's, or the page's)
    that does not exist. A path whose first directory is none of those (`OUT_DIR/x.json`) is a placeholder."""
    if not re.fullmatch(r"[\w./-]+/[\w.-]+\.\w+", token) or token.rsplit(".", 1)[-1] not in FILE_SUFFIXES:
        return None
    first = token.split("/")[0]
    roots = [root for root in (REPO, REPO / "hf_mcore_bridge", base) if (root / first).is_dir()]
    if roots and not any((root / token).exists() for root in roots):
        return "no such file"
    return None


def reference_problem(dotted: str) -> str | None:
    """None where `dotted` is a module of the package, or a name (a class's attribute too) defined in one; names
    re-exported by `from ... import` or a lazy `_EXPORTS` table are followed to where they are defined."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        source = module_source(module)
        if source is not None:
            return _attribute_problem(source, module, parts[cut:])
    return "no such module"


def _attribute_problem(source: Path, module: str, attributes: list[str]) -> str | None:
    scope: list[ast.stmt] = ast.parse(source.read_text()).body
    for depth, name in enumerate(attributes):
        found = _defined(scope, name)
        rest = attributes[depth + 1 :]
        if found is None:
            return f"{source.relative_to(REPO)} defines no {'.'.join(attributes[: depth + 1])}"
        if isinstance(found, ast.ImportFrom) and found.level == 0 and found.module:
            original = next(a.name for a in found.names if (a.asname or a.name) == name)
            return reference_problem(".".join([found.module, original, *rest]))
        if isinstance(found, ast.Assign) and isinstance(found.value, ast.Dict):  # a lazy `_EXPORTS` table
            target = next(v.value for k, v in zip(found.value.keys, found.value.values, strict=True) if k.value == name)
            package = module if source.name == "__init__.py" else module.rpartition(".")[0]
            where = target if target.startswith("hf_mcore_bridge") else f"{package}.{target}"
            return reference_problem(".".join([where, name, *rest]))
        if not isinstance(found, ast.ClassDef):
            return None  # a function's or a value's attributes are not followed
        scope = found.body
    return None


def _defined(scope: list[ast.stmt], name: str) -> ast.stmt | None:
    """The statement of `scope` that defines `name` (a lazy `_EXPORTS` table counts as defining its keys)."""
    for node in scope:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node
        if isinstance(node, ast.Assign):
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            if name in names:
                return ast.Expr(node.value)  # a value: its attributes are not followed
            if "_EXPORTS" in names and name in _dict_keys(node.value):
                return node
        if isinstance(node, (ast.Import, ast.ImportFrom)) and name in _imported_names(node):
            return node
        if isinstance(node, (ast.If, ast.Try)):
            found = _defined(node.body, name)
            if found is not None:
                return found
    return None


def _dict_keys(value: ast.expr) -> set[object]:
    return {k.value for k in value.keys if isinstance(k, ast.Constant)} if isinstance(value, ast.Dict) else set()


def _imported_names(node: ast.Import | ast.ImportFrom) -> set[str]:
    return {(alias.asname or alias.name).split(".")[0] for alias in node.names}


# A page ----------------------------------------------------------------------------------------------------------


def check_page(path: Path, page: str | None = None) -> list[str]:
    """Every problem of one Markdown page, one line each (empty: the page is current)."""
    page = page or str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)
    text = path.read_text()
    blocks, errors = fenced_blocks(text, page)
    for block in blocks:
        if block.lang in SHELL_LANGS:
            errors += ShellChecker(block).check()
        elif block.lang in PYTHON_LANGS:
            errors += check_python(block)
    return errors + check_prose(text, page, path.parent)


def doc_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
