package script

import "fmt"

// Error is a problem with the user's script or config: the CLI exits 2 on it. Msg is what the user
// reads; the error it came from, when there is one, stays reachable through Unwrap (errors.Is and
// errors.As see through to it), as starlark.EvalError keeps its cause.
type Error struct {
	Msg   string
	cause error
}

// Error returns the message the user reads.
func (e *Error) Error() string { return e.Msg }

// Unwrap returns the error the problem came from; nil when it has none.
func (e *Error) Unwrap() error { return e.cause }

// Errorf makes an Error of fmt.Errorf(format, args...): its message is that error's, and the
// errors its %w verbs wrap are its causes. Errorf("%w", err) turns err into an Error with err's
// message.
func Errorf(format string, args ...any) *Error {
	err := fmt.Errorf(format, args...)
	return &Error{Msg: err.Error(), cause: err}
}
