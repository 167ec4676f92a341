# The C module: `signal` imports enum, which takes long enough to be interrupted.
import _signal  # type: ignore[import-not-found]

# Until main() takes over Ctrl-C, it ends the process quietly, as a signal does: a Ctrl-C that
# lands during the imports would otherwise print a KeyboardInterrupt traceback.
if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
