from genome_lm.cli import run

run()
