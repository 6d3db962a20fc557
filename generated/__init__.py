"""Generated code: never edit by hand; run `kvfsm gen`."""
