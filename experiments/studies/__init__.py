"""Studies: the papers' comparisons at CPU scale (python -m experiments.studies.run)."""
