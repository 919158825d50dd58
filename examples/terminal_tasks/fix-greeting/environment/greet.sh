#!/bin/bash
name="$1"
echo "Helo, $nme!"
