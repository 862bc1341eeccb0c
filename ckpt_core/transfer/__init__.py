"""The broadcast update: process groups, the update context, agreement, stop signals, plan cache, the pipeline."""
