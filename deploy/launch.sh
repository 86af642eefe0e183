#!/bin/sh
# Start pdserve roles on this host (see deploy/README.md). Everything is done by launch.py;
# PYTHON picks the interpreter that has pdserve installed.
exec "${PYTHON:-python3}" "$(dirname "$0")/launch.py" "$@"
