# Shared by launch/torchrun.sh and launch/deepspeed.sh (sourced, not run): error reporting and
# the argument checks both make. The sourcing script sets LAUNCH_SCRIPT and defines usage().

die() {
    echo "$LAUNCH_SCRIPT: error: $*" >&2
    echo "run $LAUNCH_SCRIPT --help for the variables it reads" >&2
    exit 2
}

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

# --help anywhere prints the usage; a --config naming no file fails here, before N processes
# each fail to read it.
check_common_args() {
    local arg prev="" config
    for arg in "$@"; do
        case "$arg" in -h|--help) usage; exit 0 ;; esac
    done
    for arg in "$@"; do
        config=""
        if [ "$prev" = "--config" ]; then config="$arg"; fi
        case "$arg" in --config=*) config="${arg#--config=}" ;; esac
        if [ -n "$config" ] && [ ! -f "$config" ]; then die "--config $config: no such file"; fi
        prev="$arg"
    done
    if [ "$prev" = "--config" ]; then die "--config needs a file"; fi
}
