// Package view serves a local web page of one run folder: the curves of metrics.jsonl (per
// policy and the eval), the dataflow between policies, events.log, the config and script, and a
// browser of the rollouts a run keeps in rollouts.jsonl (each call's conversation by policy, every
// token coloured by its loss mask and advantage). The page follows a run live: its scripts poll
// endpoints that tail the files from a byte offset, taking only complete lines, so a line being
// written is read on the next poll.
//
// The server reads only the run folder's own files, through an os.Root, and by name: nothing of a
// request's path reaches the file system. Off loopback it wants a bearer token (Listen).
// `slimen view RUN` (cmd/slimen/view.go) is its command.
package view
