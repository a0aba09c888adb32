package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/gpus"
)

func init() {
	commands["gpus"] = command{"list this machine's GPUs (NVML) and, with --config, where the run's workers would go", cmdGPUs}
}

func cmdGPUs(args []string) int {
	fs := flag.NewFlagSet("gpus", flag.ContinueOnError)
	cfgPath := fs.String("config", "", "YAML config to place: each local torch worker's GPUs and memory estimate")
	asJSON := fs.Bool("json", false, "print the inventory as JSON (what --machine reads)")
	machinePath := fs.String("machine", "", "place against this saved inventory (slimen gpus --json of another machine) instead of this machine's")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: slimen gpus [--config Y] [--json] [--machine FILE]")
		fs.PrintDefaults()
	}
	pos, err := parseInterleaved(fs, args)
	if err != nil {
		return flagExit(err)
	}
	if len(pos) > 0 {
		fs.Usage()
		return 2
	}
	var inv gpus.Inventory = gpus.NVML()
	if *machinePath != "" {
		b, err := os.ReadFile(*machinePath)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		var f gpus.Fake
		if err := json.Unmarshal(b, &f.List); err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v (want the output of slimen gpus --json)\n", *machinePath, err)
			return 2
		}
		inv = f
	}
	list, err := inv.GPUs()
	noGPUs := errors.Is(err, gpus.ErrNoNVML)
	if err != nil && !noGPUs {
		fmt.Fprintln(os.Stderr, "slimen gpus:", err)
		return 1
	}
	switch {
	case *asJSON:
		b, _ := json.MarshalIndent(orEmpty(list), "", "  ")
		fmt.Println(string(b))
	case noGPUs:
		fmt.Printf("%v; the embedded engine (kind: tiny) and torch workers on --device cpu need none\n", err)
	default:
		printInventory(os.Stdout, list)
	}
	if *cfgPath == "" {
		return 0
	}
	if noGPUs {
		// As in slimen exec: without NVML nothing is placed and each worker uses the device it finds.
		fmt.Println("no placement: slimen exec starts each torch worker on the device it finds (give --machine FILE to place the config on a saved inventory)")
	}
	cfg, err := config.Load(*cfgPath)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	models := map[string]gpus.Model{}
	for _, p := range cfg.Policies {
		if !gpus.Local(p) {
			continue
		}
		m, err := gpus.ReadModel(gpus.ModelDir(p))
		if err != nil {
			fmt.Fprintf(os.Stderr, "policy %q: %v\n", p.Name, err)
			return 2
		}
		models[p.Name] = m
	}
	if noGPUs {
		return 0
	}
	plan, err := gpus.Place(cfg, models, list)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: cannot run on this machine: %v\n", *cfgPath, err)
		return 1
	}
	printPlan(os.Stdout, plan, list)
	return 0
}

func orEmpty(list []gpus.GPU) []gpus.GPU {
	if list == nil {
		return []gpus.GPU{}
	}
	return list
}

func printInventory(w io.Writer, list []gpus.GPU) {
	for _, g := range list {
		util := "utilisation unknown"
		if g.Util >= 0 {
			util = fmt.Sprintf("utilisation %d%%", g.Util)
		}
		fmt.Fprintf(w, "GPU %d  %s  %s  memory %s used of %s (%s free)  %s\n", g.Index, g.Name, g.UUID,
			gpus.GiB(g.MemUsed), gpus.GiB(g.MemTotal), gpus.GiB(g.Free()), util)
		if len(g.Processes) == 0 {
			fmt.Fprintln(w, "      no processes")
			continue
		}
		var ps []string
		for _, p := range g.Processes {
			ps = append(ps, fmt.Sprintf("pid %d (%s)", p.PID, gpus.GiB(p.Used)))
		}
		fmt.Fprintf(w, "      processes: %s\n", strings.Join(ps, ", "))
	}
}

func printPlan(w io.Writer, plan *gpus.Plan, list []gpus.GPU) {
	how := "actor + rollout (not colocated)"
	if plan.Colocate {
		how = "the larger of actor and rollout (colocated)"
	}
	fmt.Fprintf(w, "\nplacement: actor %d GPUs, rollout %d, total %d = %s; this machine has %d\n",
		plan.Actor, plan.Rollout, plan.Total, how, len(list))
	for _, wk := range plan.Workers {
		ids := make([]string, len(wk.GPUs))
		for i, g := range wk.GPUs {
			ids[i] = fmt.Sprint(g)
		}
		fmt.Fprintf(w, "  %s: GPU %s (%s), CUDA_VISIBLE_DEVICES=%s\n", wk.Policy, strings.Join(ids, ","), wk.From, strings.Join(ids, ","))
		fmt.Fprintf(w, "    memory about %s: %s\n", gpus.GiB(wk.Estimate.Total()), wk.Estimate)
		if len(wk.Shares) > 0 {
			fmt.Fprintf(w, "    shares GPU %d with %s\n", wk.GPUs[0], strings.Join(quoteAll(wk.Shares), ", "))
		}
		if len(wk.Adapters) > 0 {
			fmt.Fprintf(w, "    LoRA adapters in it: %s\n", strings.Join(quoteAll(wk.Adapters), ", "))
		}
		if len(wk.Replicas) > 0 {
			ids := make([]string, len(wk.Replicas))
			for i, g := range wk.Replicas {
				ids[i] = fmt.Sprint(g)
			}
			fmt.Fprintf(w, "    rollout replicas (rollout.max_staleness > 0: its worker keeps no versions): GPU %s, "+
				"weights pushed by NCCL broadcast\n", strings.Join(ids, ","))
		}
	}
	for _, n := range plan.NotPlaced {
		fmt.Fprintf(w, "  not placed: %s\n", n)
	}
	if len(plan.Workers) > 0 {
		fmt.Fprintln(w, "  (estimates leave out activations; a worker runs on the first GPU of its slice, "+
			"or as N ranks on its first N GPUs with num_gpus_per_node N)")
	}
}

func quoteAll(s []string) []string {
	out := make([]string, len(s))
	for i, x := range s {
		out[i] = fmt.Sprintf("%q", x)
	}
	return out
}
