"""Evaluation of GPNs with lm-eval-harness (installed as `modeling_gpn.evaluation`)."""
