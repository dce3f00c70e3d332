#!/usr/bin/env bash
# Runs a command and says on stderr how long it took, so that CI's log shows where its time goes:
#     scripts/timed.sh <label> <command> [arguments...]
# The command's exit status is kept.
label=$1
shift
start=$(date +%s)
"$@"
status=$?
echo "step-time: $label took $(($(date +%s) - start)) s (exit status $status)" >&2
exit $status
