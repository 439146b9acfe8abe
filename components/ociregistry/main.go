// Command ociregistry serves go-containerregistry's registry (pkg/registry), in memory, with the OCI 1.1
// referrers API on: the supply-chain tests' registry that has that API, beside Debian's docker-registry
// (distribution 2.8), which has not, so that both of oras's ways of attaching an SBOM are run.
//
// pkg/registry (v0.22) lists referrers, but two things distribution-spec 1.1 asks of such a registry it does not
// do, and referrers.go adds them: it answers the push of a manifest that has a subject without the OCI-Subject
// header (a client that does not see it must fall back to the referrers tag scheme), and it lists each referrer's
// artifactType as its config's media type even where the manifest names an artifactType of its own (so a
// client's filter by artifact type finds nothing), nor filters by ?artifactType=.
//
//	ociregistry [--address 127.0.0.1:0]
//
// It prints "serving on HOST:PORT" once it listens, and stops on SIGTERM or SIGINT.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"
)

func main() {
	address := flag.String("address", "127.0.0.1:0", "the address to listen on")
	flag.Parse()
	l, err := net.Listen("tcp", *address)
	if err != nil {
		log.Fatalln(err)
	}
	fmt.Printf("serving on %s\n", l.Addr())
	s := &http.Server{
		ReadHeaderTimeout: 5 * time.Second,
		Handler: withReferrersSpec(registry.New(registry.WithReferrersSupport(true),
			registry.Logger(log.New(os.Stderr, "", log.LstdFlags)))),
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = s.Shutdown(shutdown)
	}()
	if err := s.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
		log.Fatalln(err)
	}
}
