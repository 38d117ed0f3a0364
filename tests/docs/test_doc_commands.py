"""Every command, Python block and code reference that README.md and docs/ show is current (`doc_checks`), and the
checker fails on doc text gone stale: a renamed flag, sub-command, module, name, config key or file.

The `--help` outputs are cached for the whole session (one subprocess per command), so the pages and the broken
texts below share them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from doc_checks import REPO, bridge_help, check_page, doc_pages, fenced_blocks, shell_commands

PAGES = doc_pages()
STALE: dict[str, str] = {}
"""Pages known to be stale, each with its reason; strict: the mark fails once the page is fixed."""


def _page_param(path: Path) -> object:
    name = str(path.relative_to(REPO))
    marks = [pytest.mark.xfail(reason=STALE[name], strict=True)] if name in STALE else []
    return pytest.param(path, id=name, marks=marks)


@pytest.mark.parametrize("page", [_page_param(path) for path in PAGES])
def test_every_command_and_reference_of_the_page_is_current(page):
    errors = check_page(page)
    assert not errors, "\n".join(errors)


def test_the_docs_show_every_bridge_command():
    shown = set()
    for page in PAGES:
        blocks, _ = fenced_blocks(page.read_text(), page.name)
        for block in blocks:
            for words in shell_commands(block) if block.lang in ("bash", "console") else ():
                if words[0] in ("bridge", "hf-mcore-bridge") and len(words) > 1:
                    shown.add(words[1])
                if "hf_mcore_bridge.cli.main" in words:
                    shown.add(words[words.index("hf_mcore_bridge.cli.main") + 1])
    assert set(bridge_help().commands) <= shown, f"not shown in any page: {set(bridge_help().commands) - shown}"


CURRENT = """\
# A page that is current

See `hf_mcore_bridge.bridge.AutoBridge.export_hf_weights`, `grpo.max_token_mult_prob_error`,
`logger.wandb.{project,name}`, `grpo/refit/stream.py`, `OUT_DIR/placeholder.json` and [the engine](engine.md).

```bash
bridge convert --to mcore --tp 2 --pp 2 ./Llama-3.2-1B ./llama-mcore   # a comment
bridge train grpo --config examples/grpo_tiny.yaml grpo.max_num_steps=3 policy.megatron_cfg.transformer.x=1
python -m hf_mcore_bridge.grpo.data.tiny_chat /tmp/tiny_chat && pip install 'hf-mcore-bridge[loggers]'
```

<!-- gpu -->
```bash
torchrun --nproc-per-node 8 -m hf_mcore_bridge.cli.main verify /models/hf /models/mcore --tp 8
```

```console
$ hf-mcore-bridge inspect ./llama-mcore --json
{"architecture": "LlamaForCausalLM"}
```

```python
from hf_mcore_bridge import AutoBridge
from hf_mcore_bridge.engine import Engine, SamplingParams
```
"""


def _page(tmp_path: Path, text: str) -> list[str]:
    (tmp_path / "engine.md").write_text("# stand-in link target\n")
    page = tmp_path / "page.md"
    page.write_text(text)
    return check_page(page, "page.md")


def test_a_current_page_passes(tmp_path):
    assert _page(tmp_path, CURRENT) == []


def _bash(command: str, gpu: bool = False) -> str:
    return ("<!-- gpu -->\n" if gpu else "") + f"```bash\n{command}\n```\n"


BROKEN = {
    "renamed flag": (
        _bash("bridge convert --to mcore --tensor-parallel 2 ./a ./b"),
        "--tensor-parallel: not an option",
    ),
    "renamed flag, GPU block": (
        _bash("bridge verify /m/hf /m/mc --tp 8 --expert-parallel 2", gpu=True),
        "--expert-par",
    ),
    "bad choice": (_bash("bridge convert --to megatron ./a ./b"), "--to megatron: not one of mcore|hf"),
    "not an integer": (_bash("bridge convert --to mcore --tp two ./a ./b"), "--tp two: not an integer"),
    "unknown sub-command": (_bash("bridge train ppo --config examples/grpo_tiny.yaml"), "not ppo"),
    "unknown command": (_bash("bridge convertt --to hf ./a ./b"), "no sub-command `bridge convertt`"),
    "missing argument": (_bash("bridge verify ./Llama-3.2-1B --tp 2"), "takes 2-2 arguments, not 1"),
    "missing required option": (_bash("bridge convert ./a ./b"), "needs --to"),
    "renamed config key": (_bash("bridge train grpo --config examples/grpo_tiny.yaml grpo.max_steps=3"), "max_steps"),
    "renamed config section": (_bash("bridge train grpo --config examples/grpo_tiny.yaml train.seed=3"), "'train'"),
    "missing example": (
        _bash("bridge train grpo --config examples/grpo_gone.yaml"),
        "examples/grpo_gone.yaml: no such",
    ),
    "renamed module": (_bash("python -m hf_mcore_bridge.grpo.tiny_chat /tmp/x"), "no module hf_mcore_bridge.grpo.tiny"),
    "missing script": (_bash("python scripts/bench_gone.py --steps 3"), "scripts/bench_gone.py: no such"),
    "script flag": (
        _bash("torchrun --nproc-per-node 2 examples/external_rl_loop.py --step 3"),
        "--step: not an option",
    ),
    "torchrun flag": (_bash("torchrun --nproc_per_gpu 2 examples/external_rl_loop.py"), "--nproc_per_gpu: not an opt"),
    "unknown extra": (_bash("pip install 'hf-mcore-bridge[logging]'"), "no extra 'logging'"),
    "unchecked command": (_bash("curl -O https://example.com/x"), "unknown command 'curl'"),
    "renamed python module": (
        "```python\nfrom hf_mcore_bridge.grpo.trainer import train_grpo\n```\n",
        "from hf_mcore_bridge.grpo.trainer: no such module",
    ),
    "renamed python name": (
        "```python\nfrom hf_mcore_bridge.bridge import AutoBridge, export_weights\n```\n",
        "import export_weights: no such name",
    ),
    "python that does not compile": ("```python\nbridge = AutoBridge.from_pretrained(\n```\n", "does not compile"),
    "fence without language": ("```\nbridge convert --to mcore ./a ./b\n```\n", "names no language"),
    "stale module reference": ("Call `hf_mcore_bridge.grpo.trainer.train_grpo`.\n", "defines no trainer"),
    "stale name reference": (
        "Call `hf_mcore_bridge.bridge.AutoBridge.get_models`.\n",
        "defines no AutoBridge.get_models",
    ),
    "stale file": ("See `grpo/refit/streams.py`.\n", "`grpo/refit/streams.py`: no such file"),
    "stale config key": ("Set `grpo.max_token_mult_prob_err: 2`.\n", "no config key 'max_token_mult_prob_err'"),
    "broken link": ("See [the page](gone.md#x).\n", "link to gone.md#x: no such file"),
}


@pytest.mark.parametrize("text, expected", list(BROKEN.values()), ids=list(BROKEN))
def test_the_checker_fails_on_stale_doc_text(tmp_path, text, expected):
    errors = _page(tmp_path, f"# A stale page\n\n{text}")
    assert len(errors) == 1 and expected in errors[0], errors
