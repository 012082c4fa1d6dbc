"""Downstream evaluation: multiple-choice tasks scored by log-likelihood on the training layout."""
