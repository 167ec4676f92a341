import click
@click.group()
def cli() -> None:
    pass
