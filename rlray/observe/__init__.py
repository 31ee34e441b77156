"""What a run shows: console progress, metrics.jsonl, TensorBoard and wandb, report.png,
where a step's time goes, the run's memory, and evaluation comparison tables."""
