# Sourced (not run) by the scripts that install Python packages: tools/eval/install.sh,
# tools/demo.sh, tests/eval/run.sh, bindings/python/run_tests.sh. Every pip install of this
# project goes into a virtual environment under the build folder, never into the interpreter
# itself: Debian's and Ubuntu's python3 refuse that (PEP 668, "externally-managed-environment").
#
#   qjlkv_venv DIR   makes DIR a virtual environment of the python3 on PATH (once; on
#                    Debian/Ubuntu that needs the python3-venv package) and sets QJLKV_PYTHON
#                    to its interpreter
#   qjlkv_pip ARGS   pip install ARGS into it

# The evaluation's environment (tools/eval: the demo and the eval suite share it).
QJLKV_EVAL_VENV=${QJLKV_BUILD:-build}/eval-venv

qjlkv_venv() {
  local dir=$1
  # A venv made without python3-venv has a python but no pip: made again then.
  if ! "$dir/bin/python" -m pip --version >/dev/null 2>&1; then
    echo "creating the Python virtual environment $dir ($(python3 --version 2>&1) at $(command -v python3))"
    rm -rf "$dir"
    if ! python3 -m venv "$dir"; then
      echo "python3 -m venv failed: on Debian/Ubuntu install python3-venv (tools/test-all.sh deps does)" >&2
      rm -rf "$dir"
      return 1
    fi
  fi
  QJLKV_PYTHON=$dir/bin/python
}

qjlkv_pip() {
  "$QJLKV_PYTHON" -m pip install --disable-pip-version-check "$@"
}
