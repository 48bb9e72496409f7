"The benchmark of issue 4: `make bench` runs `python -m bench.run`."
