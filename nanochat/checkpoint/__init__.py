"""Checkpoints: where they live and how they load (manager), how they are written (writer), what meta.json holds
(meta), whether a run may start or resume on a tag (resume), the copy at a backup URL (backup), and the loaders that
read only data (safe_load). Entry points import from here; the modules of this room import each other directly."""

from nanochat.checkpoint.backup import Backup
from nanochat.checkpoint.manager import (
                                         Checkpoint,
                                         CheckpointError,
                                         build_model,
                                         check_tokenizer,
                                         checkpoint_bytes,
                                         checkpoint_flags,
                                         disk_room_problem,
                                         latest_model_tag,
                                         list_steps,
                                         load_model,
                                         model_dir,
                                         open_checkpoint,
                                         prune_checkpoints,
                                         read_meta,
                                         readable_bpb,
                                         remove_partial_saves,
                                         resolve_step,
                                         step_dir,
)
from nanochat.checkpoint.meta import best_of
from nanochat.checkpoint.resume import (
                                         check_data,
                                         check_data_positions,
                                         check_fresh_start,
                                         load_resume_point,
                                         move_aside,
                                         previous_run,
                                         report_schedule_change,
                                         restore,
                                         resumable_meta,
                                         resume_differences,
)
from nanochat.checkpoint.writer import CheckpointWriter, can_write_in_background, save_checkpoint

__all__ = ["Backup", "Checkpoint", "CheckpointError", "CheckpointWriter", "best_of", "build_model",
           "can_write_in_background", "check_data", "check_data_positions", "check_fresh_start", "check_tokenizer",
           "checkpoint_bytes", "checkpoint_flags", "disk_room_problem", "latest_model_tag", "list_steps", "load_model",
           "load_resume_point", "model_dir", "move_aside", "open_checkpoint", "previous_run", "prune_checkpoints",
           "read_meta", "readable_bpb", "remove_partial_saves", "report_schedule_change", "resolve_step", "restore",
           "resumable_meta", "resume_differences", "save_checkpoint", "step_dir"]
