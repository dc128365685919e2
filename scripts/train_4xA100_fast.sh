#!/usr/bin/env bash
# Phase 1 (fast): validate TRM refinement, 1000 steps, preset aggressive, on 4x A100.
# Extra arguments go to base_train and win over the table; DRY_RUN=1 prints the plan only. See scripts/launch.py.
exec bash "$(dirname "$0")/launch.sh" train 4xA100 fast "$@"
