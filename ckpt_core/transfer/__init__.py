"""The broadcast update: process groups, pre-checks and agreement, stop signals, plan cache, the pipeline."""
