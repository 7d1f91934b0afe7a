# Sourced by the example wrappers (examples/megatron/run_comparison.sh, examples/nemo/run_bridge_comparison.sh).
#
#   install_site OUT_DIR "MODULE..." WHEEL...
#
# Puts what python3 lacks into $SITE (default /tmp/site), which goes first on PYTHONPATH:
# - when one of MODULES cannot be found, the WHEELs, all in one pip call: megatron-core and
#   megatron-bridge share the folder megatron/, which pip --target replaces whole, so a second
#   call would delete what the first installed;
# - this repository, building ep_plugin._C with nvcc (log in OUT_DIR/build.log), or without it
#   when the build fails (then only ep_reference is available); nothing when python3 already
#   imports ep_plugin._C from this checkout (an editable build).
SITE=${EP_SITE:-/tmp/site}
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

install_site() {
    local out_dir=$1 modules=$2 root
    shift 2
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    mkdir -p "$out_dir" "$SITE"
    # find_spec, not import: megatron.bridge's own __init__ needs TransformerEngine (see ep_plugin/testing/bridge.py).
    # shellcheck disable=SC2086
    if ! python3 -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in sys.argv[1:]))" \
            $modules 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@"
    fi
    # An editable build of this very checkout (scripts/gpu_validate.sh makes one) needs no second build.
    # -P: what the example scripts import (PYTHONPATH first), not the current folder's source tree.
    if [[ "$(python3 -P -c 'import os, ep_plugin, ep_plugin._C; print(os.path.dirname(os.path.dirname(ep_plugin.__file__)))' \
            2>/dev/null)" == "$root" ]]; then
        echo "ep_plugin: using the build in $root" > "$out_dir/build.log"
    elif ! python3 -m pip install -q --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "$root" > "$out_dir/build.log" 2>&1; then
        echo "ep_plugin: building the CUDA extension failed (see $out_dir/build.log); installing without it:" \
             "only ep_reference will be available" >&2
        EP_PLUGIN_NO_CUDA=1 python3 -m pip install -q --no-deps --no-build-isolation --no-compile --no-cache-dir \
            --upgrade --target "$SITE" "$root"
    fi
}
