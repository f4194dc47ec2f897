// Command flashattn runs attention from the command line: one forward (and
// backward) call on NumPy files, a timed and checked training step, and
// whatever other subcommands are registered.
//
// Usage:
//
//	flashattn <command> [flags]
//
// Run "flashattn help" for the list of commands and "flashattn help <command>"
// (or "flashattn <command> -h") for a command's flags.
//
// A bad argument or input makes the command print one line on standard error
// that says what is wrong and exit with a non-zero status: 2 for a flag that
// does not parse, 1 for anything else.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
)

// command is one subcommand. Each file of this package that defines a
// subcommand registers it from its init function with register, so that
// subcommands can be added without touching the others.
type command struct {
	// name is the word that selects the command.
	name string
	// summary is the one-line description shown by "flashattn help".
	summary string
	// usage is the full help text: the synopsis and the flags.
	usage string
	// run executes the command with the arguments after its name. It
	// writes its results to stdout. It returns an error for failure; an
	// error made with usageErrorf (or flag.ErrHelp) is reported as a usage
	// problem.
	run func(args []string, stdout io.Writer) error
}

// commands holds every registered subcommand by name.
var commands = map[string]*command{}

// register adds c to the registry. It panics on a duplicate name, a
// programming error found at start-up.
func register(c *command) {
	if _, dup := commands[c.name]; dup {
		panic("flashattn: command " + c.name + " registered twice")
	}
	commands[c.name] = c
}

// usageError marks an error in the command line itself (exit status 2).
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

// usageErrorf returns a usage error with the formatted message.
func usageErrorf(format string, args ...any) error {
	return &usageError{fmt.Sprintf(format, args...)}
}

// newFlagSet returns a flag set for command c that reports nothing itself:
// parse errors come back to the caller as one-line errors.
func newFlagSet(c *command) *flag.FlagSet {
	fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return fs
}

// parseFlags parses args into fs, refusing positional arguments.
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return &usageError{err.Error()}
	}
	if fs.NArg() > 0 {
		return usageErrorf("unexpected argument %q", fs.Arg(0))
	}
	return nil
}

func main() {
	os.Exit(dispatch(os.Args[1:], os.Stdout, os.Stderr))
}

// dispatch runs the command line args (without the program name) and
// returns the exit status.
func dispatch(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, overview())
		return 2
	}
	name := args[0]
	switch name {
	case "-h", "-help", "--help":
		fmt.Fprint(stdout, overview())
		return 0
	}
	c, ok := commands[name]
	if !ok {
		fmt.Fprintf(stderr, "flashattn: unknown command %q (run \"flashattn help\" for the list)\n", name)
		return 2
	}
	err := c.run(args[1:], stdout)
	var ue *usageError
	switch {
	case err == nil:
		return 0
	case errors.Is(err, flag.ErrHelp):
		fmt.Fprint(stdout, c.usage)
		return 0
	case errors.As(err, &ue):
		fmt.Fprintf(stderr, "flashattn %s: %s (run \"flashattn %s -h\" for usage)\n", name, oneLine(err), name)
		return 2
	}
	fmt.Fprintf(stderr, "flashattn %s: %s\n", name, oneLine(err))
	return 1
}

// oneLine renders err as a single line without the library's "flashattn: "
// prefixes, which the command's own prefix already says.
func oneLine(err error) string {
	s := strings.ReplaceAll(err.Error(), "flashattn: ", "")
	return strings.Join(strings.Fields(s), " ")
}

// overview is the top-level help text.
func overview() string {
	var b strings.Builder
	b.WriteString("flashattn computes FlashAttention forward and backward on the CPU or a CUDA GPU.\n\n")
	b.WriteString("Usage:\n\n\tflashattn <command> [flags]\n\nCommands:\n\n")
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(&b, "\t%-10s %s\n", n, commands[n].summary)
	}
	b.WriteString("\nRun \"flashattn help <command>\" for a command's flags.\n")
	return b.String()
}

func init() {
	register(&command{
		name:    "help",
		summary: "show the commands, or one command's flags",
		usage:   "Usage: flashattn help [command]\n\nShows the list of commands, or the flags of one command.\n",
		run: func(args []string, stdout io.Writer) error {
			switch len(args) {
			case 0:
				fmt.Fprint(stdout, overview())
				return nil
			case 1:
				if args[0] == "-h" || args[0] == "-help" || args[0] == "--help" {
					return flag.ErrHelp
				}
				c, ok := commands[args[0]]
				if !ok {
					return usageErrorf("unknown command %q", args[0])
				}
				fmt.Fprint(stdout, c.usage)
				return nil
			}
			return usageErrorf("help takes at most one command name, got %d arguments", len(args))
		},
	})
}
