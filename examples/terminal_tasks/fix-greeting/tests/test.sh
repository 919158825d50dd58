#!/bin/bash
# passes (exit 0) when the script greets whoever it is given
set -e
[ "$(bash /app/greet.sh World)" = "Hello, World!" ]
[ "$(bash /app/greet.sh Ada)" = "Hello, Ada!" ]
