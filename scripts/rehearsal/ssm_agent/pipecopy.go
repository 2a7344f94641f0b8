// pipecopy copies its standard input into one or more files one byte per write, at the pace
// the SSM agent copies a Run Command script's output, so that a script's writes block when it
// writes faster than the agent reads, as they do on a node.
//
// Rules mirrored from aws/amazon-ssm-agent:
//   - agent/executers/executers.go ExecuteCommand: command.Stdout and command.Stderr are
//     writers, not files, so os/exec gives the script a pipe for each and copies it into the
//     plugin's DocumentIOMultiWriter;
//   - agent/framework/processor/executer/iohandler/iohandler.go Init/RegisterOutputSource:
//     the multi-writer feeds, through an io.Pipe each, the File module (file `stdout` or
//     `stderr`) and the CommandOutput module (`stdoutConsole` or `stderrConsole`), one after
//     the other (multiwriter/multiwriter.go Write);
//   - iomodule/fileS3.go and iomodule/commandoutput.go Read: bufio.NewScanner(reader),
//     scanner.Split(bufio.ScanBytes), then fileWriter.Write([]byte(scanner.Text())) for every
//     byte, the files opened with appconfig.FileFlagsCreateOrAppend and ReadWriteAccess.
//
// Usage: pipecopy FILE [FILE...] < stream. Each byte is written to each FILE in turn, one
// write each; the program ends at the end of its input.
package main

import (
	"bufio"
	"fmt"
	"os"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: pipecopy FILE [FILE...] < stream")
		os.Exit(2)
	}
	var files []*os.File
	for _, path := range os.Args[1:] {
		// appconfig.FileFlagsCreateOrAppend, appconfig.ReadWriteAccess (agent/appconfig).
		file, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY|os.O_CREATE, 0600)
		if err != nil {
			fmt.Fprintf(os.Stderr, "pipecopy: %v\n", err)
			os.Exit(1)
		}
		defer file.Close()
		files = append(files, file)
	}
	scanner := bufio.NewScanner(os.Stdin)
	scanner.Split(bufio.ScanBytes)
	for scanner.Scan() {
		for _, file := range files {
			if _, err := file.Write([]byte(scanner.Text())); err != nil {
				fmt.Fprintf(os.Stderr, "pipecopy: %v\n", err)
			}
		}
	}
	if err := scanner.Err(); err != nil {
		fmt.Fprintf(os.Stderr, "pipecopy: reading the stream: %v\n", err)
	}
}
