package main

import (
	"fmt"
	"io"
	"runtime"
	"runtime/debug"

	"github.com/flashattn/flashattn"
)

func init() {
	register(&command{
		name:    "version",
		summary: "print the version",
		usage:   "Usage: flashattn version\n\nPrints the version, the source revision when known, and the Go toolchain.\n",
		run:     runVersion,
	})
}

func runVersion(args []string, stdout io.Writer) error {
	fs := newFlagSet(commands["version"])
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	rev := ""
	if info, ok := debug.ReadBuildInfo(); ok {
		var dirty bool
		for _, s := range info.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
				if len(rev) > 12 {
					rev = rev[:12]
				}
			case "vcs.modified":
				dirty = s.Value == "true"
			}
		}
		if rev != "" && dirty {
			rev += "-dirty"
		}
	}
	if rev != "" {
		rev = " (" + rev + ")"
	}
	_, err := fmt.Fprintf(stdout, "flashattn %s%s %s %s/%s\n", flashattn.Version, rev, runtime.Version(), runtime.GOOS, runtime.GOARCH)
	return err
}
