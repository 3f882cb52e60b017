from .utils.startup import install_interrupt_hook

install_interrupt_hook()  # before the heavy imports: Ctrl-C while starting gives one line

from .cli import main  # noqa: E402

if __name__ == "__main__":
    main()
