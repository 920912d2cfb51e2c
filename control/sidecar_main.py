"""Entry point of the sidecar process: `python -m kvbaton.control.sidecar_main CONFIG_JSON`.

xoscar loads serializers for torch, cupy... lazily, on the first message its dispatcher
cannot place, which is the first call to a peer: seconds of imports in front of the first claim,
and far longer when the engines next door keep every core busy. The sidecar only exchanges plain
Python values, so it marks those packages absent before xoscar loads (a `None` entry in
`sys.modules` makes `find_spec` answer "not installed" and `import` fail fast), with
`control.client.keep_xoscar_light`.
"""


def main() -> None:
    from .client import keep_xoscar_light

    keep_xoscar_light()
    from .sidecar import main as sidecar_main

    sidecar_main()


if __name__ == "__main__":
    main()
