"""µP's coordinate check on your own config and layout (`nanotron coord-check`): `runs.py` trains and measures,
`report.py` judges and draws."""
