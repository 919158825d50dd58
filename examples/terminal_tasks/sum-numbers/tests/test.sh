#!/bin/bash
# reward 1 when /app/sum.txt holds the sum of /app/numbers.txt, else 0
mkdir -p /logs/verifier
expected=$(awk '{ s += $1 } END { print s }' /app/numbers.txt)
if [ -f /app/sum.txt ] && [ "$(tr -d '[:space:]' < /app/sum.txt)" = "$expected" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
