#!/usr/bin/env bash
# Phase 2 (extreme): the final model, 5000 steps, preset extreme, on 4x H100.
# Extra arguments go to base_train and win over the table; DRY_RUN=1 prints the plan only. See scripts/launch.py.
exec bash "$(dirname "$0")/launch.sh" train 4xH100 extreme "$@"
