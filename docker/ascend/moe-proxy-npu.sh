#!/bin/bash
# Load CANN's environment (libraries, ASCEND_* paths), then run the real moe-proxy.
# No `set -e`: a set_env.sh whose last test is false must not stop the run.
for env in /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/nnal/atb/set_env.sh; do
    # shellcheck disable=SC1090
    if [ -f "$env" ]; then source "$env"; fi
done
exec /opt/moe-proxy/bin/moe-proxy "$@"
