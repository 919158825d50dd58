#!/bin/sh
# The server image's entrypoint: `agentjet-server up --resume`, configured by the environment.
# Every option of `up` has a variable (--checkpoint-uri: AGENTJET_SERVER_CHECKPOINT_URI); keys come from
# AGENTJET_API_KEYS / AGENTJET_ADMIN_KEYS (e.g. from a Secret) or from files (AGENTJET_SERVER_API_KEY_FILE),
# never from arguments, which any user of the machine can read in ps.
# --resume: a restarted container continues its run (an empty state dir is a fresh start, or a restore
# from --checkpoint-uri).
set -eu
for arg in "$@"; do
    case "$arg" in
        --api-key | --api-key=* | --admin-key | --admin-key=*)
            echo "agentjet-entrypoint: keys are not taken as arguments (ps shows them): set AGENTJET_API_KEYS," \
                "or mount a file and set AGENTJET_SERVER_API_KEY_FILE" >&2
            exit 2
            ;;
    esac
done
if [ "$#" -gt 0 ] && [ "${1#-}" = "$1" ]; then
    exec "$@" # a command of its own (a shell, agentjet-server admin ...)
fi
exec agentjet-server up --resume "$@"
