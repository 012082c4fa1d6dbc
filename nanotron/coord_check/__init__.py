"""`nanotron coord-check`: µP's coordinate check on your own config and layout (cli.py; runs.py trains and
measures, report.py judges and draws)."""
