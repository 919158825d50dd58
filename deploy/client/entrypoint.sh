#!/bin/sh
# The client image's entrypoint: `agentjet-client run`, configured by the environment alone.
#   AGENTJET_CLIENT_SERVER      the server's URL (required), e.g. http://agentjet-server:8000
#   AGENTJET_CLIENT_CODE_DIR    the agent's directory (or AGENTJET_CLIENT_ENV: an environment you have)
#   AGENTJET_CLIENT_API_KEY_FILE  a file holding the key (a mounted Secret); or AGENTJET_API_KEY
#   AGENTJET_CLIENT_<OPTION>    any other option of `agentjet-client run` (EPISODES, CONCURRENCY, ...)
# The spool (finished trajectories not yet acknowledged) is in AGENTJET_CLIENT_SPOOL_DIR: on a volume that
# outlives the container, a restarted client sends what its predecessor left. SIGTERM ends the run as
# Ctrl-C does: what is spooled stays spooled.
set -eu
for arg in "$@"; do
    case "$arg" in
        --api-key | --api-key=*)
            echo "agentjet-entrypoint: the API key is not taken as an argument (ps shows it): mount it as a file" \
                "and set AGENTJET_CLIENT_API_KEY_FILE, or set AGENTJET_API_KEY" >&2
            exit 2
            ;;
    esac
done
if [ "$#" -gt 0 ] && [ "${1#-}" = "$1" ]; then
    exec "$@" # a command of its own (a shell, agentjet-client status ...)
fi
if [ -z "${AGENTJET_CLIENT_SERVER:-}" ]; then
    echo "agentjet-entrypoint: set AGENTJET_CLIENT_SERVER to the server's URL, e.g. http://agentjet-server:8000" >&2
    exit 2
fi
if [ -z "${AGENTJET_CLIENT_CODE_DIR:-}" ] && [ -z "${AGENTJET_CLIENT_ENV:-}" ]; then
    echo "agentjet-entrypoint: set AGENTJET_CLIENT_CODE_DIR to the agent's directory (a volume, or COPY it into" \
        "an image built FROM this one), or AGENTJET_CLIENT_ENV to an environment (gymnasium:ID, openenv:URL)" >&2
    exit 2
fi
if [ -n "${AGENTJET_CLIENT_API_KEY_FILE:-}" ] && [ ! -r "$AGENTJET_CLIENT_API_KEY_FILE" ]; then
    echo "agentjet-entrypoint: AGENTJET_CLIENT_API_KEY_FILE=$AGENTJET_CLIENT_API_KEY_FILE cannot be read;" \
        "mount the Secret there" >&2
    exit 2
fi
exec agentjet-client run "$@"
