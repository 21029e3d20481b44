"""The notebooks' studies, one module per notebook where a notebook needs one: the scan timed
(timing), the benchmark harness (bench), throughput and race studies (studies), the A
parameterisation (dynamics), the selection results (selection), generation (generate), plus the
notebooks' parameter ranges (notebook), figures (plots) and peer models (peers)."""
