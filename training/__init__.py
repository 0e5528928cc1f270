"""Training: self-distillation, features, loss, trainer."""
