"""The fitted cost model of an engine and its calibration by measured times (conductor, decode, `profile`)."""
